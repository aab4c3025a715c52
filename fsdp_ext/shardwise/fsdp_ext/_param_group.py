"""One ``fully_shard`` unit's parameters: sharded storage, one all-gather, one reduce-scatter.

Memory layout (per rank, per unit)
----------------------------------
Every managed parameter is cut along its shard dim (0 unless ``shard_placement_fn`` says
otherwise; a "row" below is one index of that dim, and the flat buffers hold each parameter
with that dim moved first) over the data-parallel (dp) group with torch.chunk semantics: ``rows`` rows become pieces of ``padded_rows = ceil(rows / dp)`` rows,
the trailing ones shorter or empty.  Each rank keeps its pieces of all the unit's parameters
in ONE flat buffer (``sharded_flat``), every piece padded to ``padded_rows`` rows, so that:

- the all-gather sends ``sharded_flat`` as it is (cast to ``param_dtype`` first under mixed
  precision): one collective per unit, no copy on the way in;
- the sharded parameters the user and the optimizer see are views into ``sharded_flat`` (the
  real rows only: the padding is never visible), so an in-place optimizer step updates what
  the next all-gather sends;
- the gathered buffer reads ``(dp, per-rank flat)``; the first ``rows`` rows of a parameter's
  ``dp`` padded pieces, in rank order, are its rows in order (torch.chunk puts the padding at
  the end), so copying it out takes at most two copies per parameter.

The unsharded parameters are views into one flat buffer per unit (``unsharded_flat``) whose
storage is freed on reshard (resized to 0 bytes) and refilled on the next unshard.  Tensors
that autograd saved in forward alias that storage, so refilling it before backward gives
them their values back; the refill keeps the version counter so autograd does not mistake it
for an in-place edit.

Backward: the unit's unsharded parameters come out of one autograd function
(:class:`_UnshardedParams`), so their gradients arrive together, once per unit; they are
copied into one flat ``(dp, per-rank flat)`` buffer (padding left as garbage: it is dropped),
reduce-scattered in one collective, divided by dp, and handed back as the sharded parameters'
gradients: views into the reduce-scatter's output.

One parameter's slots in these buffers and its layouts are ``FSDPParam``'s (``_managed_param``,
with ``SpmdLayout`` and ``ParamOwner``; all three stay importable from here).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardwise.dtensor_ops import DTensor
from shardwise.dtensor_ops._collectives import (
    launch_all_gather,
    launch_all_reduce,
    launch_reduce_scatter,
    mesh_dim_group_name,
    wait,
)
from shardwise.mesh import DeviceMesh
from shardwise.placement import Partial, Replicate, Shard

from ._errors import FSDPError
from ._managed_param import FSDPParam, ParamOwner, SpmdLayout

__all__ = ["FSDPParam", "FSDPParamGroup", "FSDPParamGroups", "ParamOwner", "SpmdLayout"]


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def _recompute_everything_contexts() -> Any:
    """Selective activation checkpointing that saves nothing of the region: backward recomputes all of it."""
    return create_selective_checkpoint_contexts(_recompute_everything)


class _UnshardedParams(torch.autograd.Function):
    """Sharded parameters in, the unit's unsharded parameters out; backward reduce-scatters once per unit."""

    @staticmethod
    def forward(
        ctx: Any, group: FSDPParamGroup, *sharded_params: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        # detach(): a fresh tensor object on the same storage per forward (autograd attaches this
        # call's graph to it), so freeing and refilling the storage reaches every saved alias.
        return tuple(view.detach() for view in group.unsharded_views_with_grad())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        group: FSDPParamGroup = ctx.group
        sharded_grads = group.post_backward(grads)
        return (None, *sharded_grads)


class FSDPParamGroup:
    """The managed parameters of one ``fully_shard`` unit and their collectives."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter, list[ParamOwner]]],
        dp_mesh: DeviceMesh,
        *,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        shard_dims: Sequence[int] | None = None,
        spmd_layouts: Sequence[SpmdLayout] | None = None,
    ) -> None:
        self.dp_mesh = dp_mesh
        # Gathers and reduce-scatters run over the last dim of the dp mesh; with HSDP the
        # reduce-scattered gradients are then all-reduced over the first (the replicas).
        self.dp_size = dp_mesh.shape[-1]
        self.group_name = mesh_dim_group_name(dp_mesh, dp_mesh.ndim - 1)
        self.replicate_size = dp_mesh.shape[0] if dp_mesh.ndim == 2 else 1
        self.replicate_group_name = mesh_dim_group_name(dp_mesh, 0) if self.replicate_size > 1 else None
        dtypes = {param.dtype for _, param, _ in params}
        if len(dtypes) > 1:
            listing = ", ".join(f"{fqn}: {param.dtype}" for fqn, param, _ in params)
            raise FSDPError(
                f"fully_shard: one unit gathers its parameters in one flat buffer, so they need one dtype; "
                f"got {sorted(str(d) for d in dtypes)} ({listing}); expected a single dtype per unit "
                "(apply fully_shard to the submodules with other dtypes first, or set mp_policy.param_dtype)"
            )
        self.orig_dtype = dtypes.pop()
        self.param_dtype = param_dtype or self.orig_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.device = params[0][1].device
        self.fsdp_params: list[FSDPParam] = []
        sharded_numel = unsharded_numel = 0
        for index, (fqn, param, owners) in enumerate(params):
            if param.dim() == 0:
                raise FSDPError(
                    f"fully_shard: parameter {fqn!r} is 0-dimensional; FSDP shards dim 0, expected parameters "
                    "with at least one dim (pass it in ignored_params to leave it as it is)"
                )
            shard_dim = shard_dims[index] if shard_dims is not None else 0
            spmd = spmd_layouts[index] if spmd_layouts is not None else None
            fsdp_param = FSDPParam(fqn, param, owners, dp_mesh, sharded_numel, unsharded_numel, shard_dim, spmd)
            sharded_numel += fsdp_param.padded_numel
            unsharded_numel += fsdp_param.unsharded_numel
            self.fsdp_params.append(fsdp_param)
        self.sharded_numel = sharded_numel
        self.unsharded_numel = unsharded_numel
        # Each rank keeps only its pieces (plus padding to equal sizes).
        self.sharded_flat = torch.zeros(sharded_numel, dtype=self.orig_dtype, device=self.device)
        for fsdp_param, (_, param, _) in zip(self.fsdp_params, params):
            local = param._local_tensor if isinstance(param, DTensor) else param.data
            rows = local.narrow(fsdp_param.shard_dim, fsdp_param.local_row_offset, fsdp_param.local_rows)
            fsdp_param.sharded_local_view(self.sharded_flat).copy_(rows)
        self.unsharded_flat = torch.empty(unsharded_numel, dtype=self.param_dtype, device=self.device)
        # Views first: a view of a storage of 0 bytes cannot be made.
        self._unsharded_views = [p.unsharded_view(self.unsharded_flat) for p in self.fsdp_params]
        self._free_unsharded()
        self.is_unsharded = False
        self._pending_gather: torch.Tensor | None = None
        self.requires_gradient_sync = True
        # HSDP: off, backward reduce-scatters within the replica and keeps the sum (sharded) for the
        # next backward with the all-reduce across replicas on.
        self.requires_all_reduce = True
        self._partial_reduced: torch.Tensor | None = None
        # set_gradient_divide_factor / set_force_sum_reduction_for_comms / set_all_reduce_hook.
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.reshard_after_backward = True
        self._accumulated_grad: torch.Tensor | None = None  # unsharded, while gradient sync is off
        # id(FSDPParam) -> tp mesh dims over which this backward's gradient is still a Partial sum.
        self.partial_grad_dims: dict[int, tuple[int, ...]] = {}
        self.backward_ran = False
        # reshard_after_forward=int: after forward keep the gathered buffer's rows of the dp ranks
        # that this rank's member index stands for, and gather them back within its smaller group
        # (group name, group size, member index) before backward.
        self.post_forward_group: tuple[str, int, int] | None = None
        self._gathered: torch.Tensor | None = None
        self._post_forward_shard: torch.Tensor | None = None

    def set_post_forward_group(self, mesh_and_dim: tuple[DeviceMesh, int]) -> None:
        mesh, dim = mesh_and_dim
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        self.post_forward_group = (mesh_dim_group_name(mesh, dim), mesh.shape[dim], coordinate[dim])

    # -- sharded parameters -----------------------------------------------------

    def make_sharded_params(self) -> list[nn.Parameter]:
        """Register the sharded DTensor parameters on their modules (in place of the originals)."""
        sharded: list[nn.Parameter] = []
        for fsdp_param in self.fsdp_params:
            local = fsdp_param.sharded_local_view(self.sharded_flat)
            param = nn.Parameter(DTensor(local, fsdp_param.sharded_spec, requires_grad=False),
                                 requires_grad=fsdp_param.requires_grad)
            fsdp_param.sharded_param = param
            fsdp_param._sharded_local_ptr = local.data_ptr()
            sharded.append(param)
        self.use_sharded_params()
        return sharded

    def use_sharded_params(self) -> None:
        for fsdp_param in self.fsdp_params:
            assert fsdp_param.sharded_param is not None
            for owner in fsdp_param.owners:
                owner.module._parameters[owner.name] = fsdp_param.sharded_param

    def _local_tensors(self) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for fsdp_param in self.fsdp_params:
            param = fsdp_param.sharded_param
            assert param is not None
            tensors.append(param._local_tensor)  # type: ignore[attr-defined]
        return tensors

    def reset_sharded_storage(self) -> bool:
        """Make the sharded parameters' local tensors views of ``sharded_flat`` again, keeping their values.

        For whatever replaced them in place of the parameter objects the optimizer holds
        (``nn.Module._apply``: ``to_empty``, ``to``; ``param.data = ...``). When every local tensor moved to
        another device (``fully_shard`` on the meta device, then ``to_empty(device=...)``), the flat
        buffers are allocated anew there (uninitialised, as ``to_empty``'s tensors are), so in-place
        initialisation of the DTensor parameters writes straight into what the next all-gather sends.
        Returns False, changing nothing, while the local tensors are on several devices (a list unit
        half-way through ``_apply``) or on a device other than the mesh's (still meta).
        """
        tensors = self._local_tensors()
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            return False
        device = devices.pop()
        if device.type != self.dp_mesh.device_type:
            return False
        if device != self.sharded_flat.device:
            self._move_buffers(device)
        self._sync_sharded_storage()
        return True

    def _move_buffers(self, device: torch.device) -> None:
        """Allocate the flat buffers on ``device``; nothing gathered, pending or accumulated survives."""
        self.reset()
        self.device = device
        self.sharded_flat = torch.empty(self.sharded_numel, dtype=self.orig_dtype, device=device)
        self.unsharded_flat = torch.empty(self.unsharded_numel, dtype=self.param_dtype, device=device)
        self._unsharded_views = [p.unsharded_view(self.unsharded_flat) for p in self.fsdp_params]
        self._free_unsharded()
        for fsdp_param in self.fsdp_params:
            fsdp_param._sharded_local_ptr = -1  # no local tensor is a view of the new buffer yet

    def check_materialized(self) -> None:
        """Refuse to gather parameters still on the meta device (or elsewhere than the mesh's device)."""
        off = [
            f"{p.fqn} ({t.device})"
            for p, t in zip(self.fsdp_params, self._local_tensors())
            if t.device.type != self.dp_mesh.device_type
        ]
        if off:
            raise FSDPError(
                f"fully_shard: parameters {', '.join(off)} are not on the {self.dp_mesh.device_type!r} device of "
                f"their mesh {self.dp_mesh!r}; expected parameters created on the meta device to be materialised "
                "before the first forward or unshard: call module.to_empty(device=...) and initialise them "
                "(e.g. module.init_weights() or reset_parameters())"
            )

    def _sync_sharded_storage(self) -> None:
        """Copy in sharded parameters whose local tensor was replaced (``param.data = ...``, ``to_empty``)."""
        for fsdp_param, local in zip(self.fsdp_params, self._local_tensors()):
            param = fsdp_param.sharded_param
            assert param is not None
            view = fsdp_param.sharded_local_view(self.sharded_flat)
            if local.data_ptr() != fsdp_param._sharded_local_ptr or local.device != view.device:
                if local.dtype != self.orig_dtype:
                    raise FSDPError(
                        f"fully_shard: parameter {fsdp_param.fqn!r} became {local.dtype} after fully_shard (which "
                        f"laid it out as {self.orig_dtype}); expected dtype changes before fully_shard, or "
                        "mp_policy=MixedPrecisionPolicy(param_dtype=...) for compute in another dtype"
                    )
                if not local.is_meta and view.data_ptr() != local.data_ptr():
                    view.copy_(local)
                param._local_tensor = view  # type: ignore[attr-defined]
                fsdp_param._sharded_local_ptr = view.data_ptr()

    # -- unshard / reshard --------------------------------------------------------

    def launch_unshard(self) -> None:
        """Start the unit's all-gather (one collective) unless it is unsharded or already on its way."""
        if self.is_unsharded or self._pending_gather is not None:
            return
        post_forward = self._post_forward_shard
        if post_forward is not None and self.post_forward_group is not None:
            # The (dp, per-rank flat) buffer back from the smaller group's blocks, in member order.
            self._post_forward_shard = None
            name, size, _ = self.post_forward_group
            with torch.no_grad():
                self._pending_gather = launch_all_gather(post_forward.view(-1), size, name)
            return
        self.check_materialized()
        self.reset_sharded_storage()
        send = self.sharded_flat
        if send.dtype != self.param_dtype:
            send = send.to(self.param_dtype)
        with torch.no_grad():
            self._pending_gather = launch_all_gather(send, self.dp_size, self.group_name)

    def wait_unshard(self) -> None:
        """Finish the all-gather and fill the unsharded parameters."""
        if self.is_unsharded:
            return
        self.launch_unshard()
        pending = self._pending_gather
        assert pending is not None
        self._pending_gather = None
        with torch.no_grad():
            gathered = wait(pending).view(self.dp_size, self.sharded_numel)
            storage = self.unsharded_flat.untyped_storage()
            with torch.autograd._unsafe_preserve_version_counter(self.unsharded_flat):
                storage.resize_(self.unsharded_numel * self.unsharded_flat.element_size())
                for fsdp_param in self.fsdp_params:
                    fsdp_param.copy_out_gathered(gathered, self.unsharded_flat)
        if self.post_forward_group is not None and torch.is_grad_enabled():
            self._gathered = gathered
        self.is_unsharded = True

    def reset(self) -> None:
        """Forget everything of an aborted iteration: in-flight gathers, kept shares, pending gradients."""
        self.reshard()
        self._accumulated_grad = None
        self._partial_reduced = None
        self.partial_grad_dims = {}

    def drop_post_forward_shard(self) -> None:
        self._post_forward_shard = None

    def reshard_after_forward(self) -> None:
        """Free the unsharded parameters, keeping a smaller group's share when resharding to one."""
        gathered = self._gathered
        if self.post_forward_group is not None and gathered is not None:
            _, size, index = self.post_forward_group
            block = self.dp_size // size
            self._post_forward_shard = gathered.narrow(0, index * block, block).clone()
        self.reshard(keep_post_forward_shard=True)

    def reshard(self, keep_post_forward_shard: bool = False) -> None:
        """Free the unsharded parameters' memory (their tensors stay, with no storage)."""
        self._gathered = None
        if not keep_post_forward_shard:
            # Only the backward right after a forward may use it: the sharded parameters may change after.
            self._post_forward_shard = None
        if self._pending_gather is not None:
            wait(self._pending_gather)
            self._pending_gather = None
        if self.is_unsharded:
            self._free_unsharded()
            self.is_unsharded = False

    def _free_unsharded(self) -> None:
        self.unsharded_flat.untyped_storage().resize_(0)

    def unsharded_views_with_grad(self) -> list[torch.Tensor]:
        return [view for view, p in zip(self._unsharded_views, self.fsdp_params) if p.requires_grad]

    def use_unsharded_params(self) -> None:
        """Point the modules at the unsharded parameters (through the autograd function when grads are on)."""
        with_grad = [p for p in self.fsdp_params if p.requires_grad]
        tensors: dict[int, torch.Tensor] = {}
        if torch.is_grad_enabled() and with_grad:
            self.backward_ran = False
            sharded = [p.sharded_param for p in with_grad]
            outputs = _UnshardedParams.apply(self, *sharded)
            for fsdp_param, output in zip(with_grad, outputs):
                tensors[id(fsdp_param)] = output
        for fsdp_param, view in zip(self.fsdp_params, self._unsharded_views):
            tensor = tensors.get(id(fsdp_param))
            if tensor is None:
                tensor = view.detach()
            value = fsdp_param.unsharded_for_module(tensor, self)
            for owner in fsdp_param.owners:
                owner.module._parameters[owner.name] = value  # type: ignore[assignment]

    def use_unsharded_params_in_backward(self) -> None:
        """Point the modules at the unsharded parameters for recomputation in backward (activation checkpointing).

        Fresh leaves on the unsharded storage, requiring gradients as the forward's did (so that the recomputed
        ops save the same tensors, which checkpointing checks); the recomputed graph is only read for its saved
        tensors, never differentiated: the gradients still come through the forward's ``_UnshardedParams``.
        """
        with torch.enable_grad():
            for fsdp_param, view in zip(self.fsdp_params, self._unsharded_views):
                tensor = view.detach().requires_grad_(fsdp_param.requires_grad)
                value = fsdp_param.unsharded_for_module(tensor, self)
                for owner in fsdp_param.owners:
                    owner.module._parameters[owner.name] = value  # type: ignore[assignment]

    def use_traced_unsharded_params(self, regather_in_backward: bool) -> None:
        """Point the modules at unsharded parameters built by traceable ops (inside a compiled graph).

        Options whose eager behaviour is bookkeeping between hooks are refused first. ``regather_in_backward``
        (``reshard_after_forward``, not the root): the gather runs under selective activation checkpointing
        that recomputes all of it, so the graph keeps no unsharded parameter for backward and gathers
        again there, as eager FSDP does.
        """
        self.check_traceable()
        if regather_in_backward:
            unsharded = checkpoint(self._traced_gather, use_reentrant=False, context_fn=_recompute_everything_contexts)
        else:
            unsharded = self._traced_gather()
        for fsdp_param, tensor in zip(self.fsdp_params, unsharded):
            value = fsdp_param.traced_for_module(tensor)
            for owner in fsdp_param.owners:
                owner.module._parameters[owner.name] = value  # type: ignore[assignment]

    def _traced_gather(self) -> tuple[torch.Tensor, ...]:
        """The unit's unsharded pieces from its sharded parameters: one all-gather, and in backward one
        reduce-scatter, as in eager, written as differentiable DTensor ops.

        This rank's padded pieces, concatenated as in ``sharded_flat``, are read as the ``Shard(0)`` piece
        of a flat DTensor over the dp mesh and redistributed to Replicate (cast to ``param_dtype`` before
        the all-gather); the local result is declared to receive a Partial gradient (avg over dp, or sum
        with ``set_force_sum_reduction_for_comms``), so autograd's backward of the redistribution is the
        reduce-scatter of the packed gradients (in ``reduce_dtype``, divided by the dp size, cast back).
        """
        dp_mesh = self.dp_mesh
        send = torch.cat([fsdp_param.traced_padded_piece() for fsdp_param in self.fsdp_params])
        flat = DTensor.from_local(
            send,
            dp_mesh,
            (*(Replicate(),) * (dp_mesh.ndim - 1), Shard(0)),
            shape=(self.dp_size * self.sharded_numel,),
            stride=(1,),
        )
        replicated = flat.redistribute(
            dp_mesh,
            (Replicate(),) * dp_mesh.ndim,
            forward_dtype=self.param_dtype if self.param_dtype != self.orig_dtype else None,
            backward_dtype=self.reduce_dtype if self.reduce_dtype != self.orig_dtype else None,
        )
        reduce_op = "sum" if self.force_sum_reduction else "avg"
        gathered = replicated.to_local(grad_placements=(Partial(reduce_op),) * dp_mesh.ndim)
        gathered = gathered.view(self.dp_size, self.sharded_numel)
        return tuple(fsdp_param.traced_unsharded_from_gathered(gathered) for fsdp_param in self.fsdp_params)

    def check_traceable(self) -> None:
        """Refuse, at trace time, the options a compiled forward cannot honour."""
        unit = ", ".join(p.fqn for p in self.fsdp_params[:3]) + (", ..." if len(self.fsdp_params) > 3 else "")
        refused: list[str] = []
        if not self.requires_gradient_sync:
            refused.append("set_requires_gradient_sync(False) (local gradient accumulation is kept between backwards)")
        if not self.requires_all_reduce:
            refused.append("set_requires_all_reduce(False) (HSDP partial sums are kept between backwards)")
        if self.gradient_divide_factor is not None:
            refused.append(f"set_gradient_divide_factor({self.gradient_divide_factor})")
        if self.all_reduce_hook is not None:
            refused.append("set_all_reduce_hook(...)")
        if any(p.compute_dp_dims for p in self.fsdp_params):
            refused.append("dp_mesh_dims (parameters on a full SPMD mesh)")
        if self.post_forward_group is not None:
            refused.append(
                f"reshard_after_forward={self.post_forward_group[1]} (a share kept for a smaller group after forward)"
            )
        if refused:
            raise FSDPError(
                f"fully_shard under torch.compile: the unit of {unit} uses {'; '.join(refused)}, which a compiled "
                "graph cannot honour (it keeps no state between forward and backward outside the graph); expected "
                "these options at their defaults while compiling, or a compiled region that excludes the fully_shard "
                "modules (compile each block's forward instead)"
            )

    # -- backward -----------------------------------------------------------------

    def post_backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Gradients of the unsharded parameters in, the sharded parameters' gradients out."""
        self.backward_ran = True
        self.use_sharded_params()  # the pre-backward hook put the unsharded ones on the modules
        with_grad = [p for p in self.fsdp_params if p.requires_grad]
        if self.reshard_after_backward:
            self.reshard()
        with torch.no_grad():
            grads = self._reduce_partial_grads(with_grad, grads)
            if not self.requires_gradient_sync:
                self._accumulate_unsharded(with_grad, grads)
                return [None] * len(with_grad)
            reduce_input = torch.empty((self.dp_size, self.sharded_numel), dtype=self.reduce_dtype, device=self.device)
            accumulated = self._accumulated_grad
            self._accumulated_grad = None
            for fsdp_param, grad in zip(with_grad, grads):
                full = self._unsharded_grad(fsdp_param, grad, accumulated)
                fsdp_param.copy_in_gradient(full, reduce_input)
            reduced = wait(launch_reduce_scatter(reduce_input.view(-1), "sum", self.dp_size, self.group_name))
            if self.replicate_group_name is not None:
                if self._partial_reduced is not None:
                    reduced = reduced + self._partial_reduced
                    self._partial_reduced = None
                if not self.requires_all_reduce:
                    # HSDP accumulation: sum within the replica now, across replicas later.
                    self._partial_reduced = reduced
                    return [None] * len(with_grad)
                reduced = wait(launch_all_reduce(reduced, "sum", self.replicate_group_name))
            if not self.force_sum_reduction:
                reduced.div_(self.gradient_divide_factor or self.dp_size * self.replicate_size)
            if self.all_reduce_hook is not None:
                self.all_reduce_hook(reduced)
            sharded_grads: list[torch.Tensor | None] = []
            for fsdp_param in with_grad:
                local = fsdp_param.sharded_local_view(reduced)
                if local.dtype != fsdp_param.orig_dtype:
                    local = local.to(fsdp_param.orig_dtype)
                sharded_grads.append(DTensor(local, fsdp_param.sharded_spec, requires_grad=False))
            return sharded_grads

    def _reduce_partial_grads(
        self, with_grad: list[FSDPParam], grads: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Sum the gradients left Partial over tp (DTensors say so by their placements, annotated plain
        parameters by their R types): one all-reduce per (tp mesh, mesh dims) in this unit."""
        pending = self.partial_grad_dims
        self.partial_grad_dims = {}
        result: list[torch.Tensor | None] = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
        batches: dict[tuple[DeviceMesh, tuple[int, ...]], list[int]] = {}
        for index, fsdp_param in enumerate(with_grad):
            dims = pending.get(id(fsdp_param)) or (fsdp_param.plain.partial_grad_dims if fsdp_param.plain else None)
            if dims and result[index] is not None and fsdp_param.compute_spec is not None:
                batches.setdefault((fsdp_param.compute_spec.mesh, dims), []).append(index)
        for (mesh, dims), indices in batches.items():
            pieces = [result[i] for i in indices]
            flat = torch.cat([p.reshape(-1).to(self.reduce_dtype) for p in pieces if p is not None])
            for mesh_dim in dims:
                flat = wait(launch_all_reduce(flat, "sum", mesh_dim_group_name(mesh, mesh_dim)))
            offset = 0
            for i in indices:
                piece = result[i]
                assert piece is not None
                result[i] = flat.narrow(0, offset, piece.numel()).view(piece.shape)
                offset += piece.numel()
        return result

    def _unsharded_grad(
        self, fsdp_param: FSDPParam, grad: torch.Tensor | None, accumulated: torch.Tensor | None
    ) -> torch.Tensor:
        if isinstance(grad, DTensor):
            grad = grad._local_tensor
        if grad is None:
            grad = torch.zeros(fsdp_param.unsharded_shape, dtype=self.reduce_dtype, device=self.device)
        if accumulated is not None:
            grad = grad + fsdp_param.unsharded_view(accumulated)
        return grad

    def _accumulate_unsharded(self, with_grad: list[FSDPParam], grads: Sequence[torch.Tensor | None]) -> None:
        if self._accumulated_grad is None:
            self._accumulated_grad = torch.zeros(self.unsharded_numel, dtype=self.reduce_dtype, device=self.device)
        for fsdp_param, grad in zip(with_grad, grads):
            if grad is None:
                continue
            if isinstance(grad, DTensor):
                grad = grad._local_tensor
            fsdp_param.unsharded_view(self._accumulated_grad).add_(grad)


class FSDPParamGroups:
    """The parameter groups of one unit whose parameters live on several data-parallel meshes (a
    ``shard_placement_fn`` returning ``ShardPlacementResult``s), driven together: one all-gather and one
    reduce-scatter per group. Settings assigned to it (``requires_gradient_sync``, ...) reach every group."""

    _SETTINGS = frozenset(
        {
            "requires_gradient_sync",
            "requires_all_reduce",
            "reshard_after_backward",
            "gradient_divide_factor",
            "force_sum_reduction",
            "all_reduce_hook",
        }
    )

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        object.__setattr__(self, "groups", groups)
        self.groups: list[FSDPParamGroup]

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._SETTINGS:
            raise AttributeError(f"FSDPParamGroups has no setting {name!r}")
        for group in self.groups:
            setattr(group, name, value)

    def __getattr__(self, name: str) -> Any:
        if name in FSDPParamGroups._SETTINGS:
            return getattr(self.groups[0], name)
        raise AttributeError(name)

    @property
    def fsdp_params(self) -> list[FSDPParam]:
        return [p for group in self.groups for p in group.fsdp_params]

    @property
    def is_unsharded(self) -> bool:
        return all(group.is_unsharded for group in self.groups)

    def make_sharded_params(self) -> list[nn.Parameter]:
        return [p for group in self.groups for p in group.make_sharded_params()]

    def launch_unshard(self) -> None:
        for group in self.groups:
            group.launch_unshard()

    def reset_sharded_storage(self) -> bool:
        return all([group.reset_sharded_storage() for group in self.groups])

    def check_materialized(self) -> None:
        for group in self.groups:
            group.check_materialized()

    def wait_unshard(self) -> None:
        self.launch_unshard()  # every gather in flight before the first wait
        for group in self.groups:
            group.wait_unshard()

    def drop_post_forward_shard(self) -> None:
        for group in self.groups:
            group.drop_post_forward_shard()

    def use_unsharded_params(self) -> None:
        for group in self.groups:
            group.use_unsharded_params()

    def use_sharded_params(self) -> None:
        for group in self.groups:
            group.use_sharded_params()

    def use_unsharded_params_in_backward(self) -> None:
        for group in self.groups:
            group.use_unsharded_params_in_backward()

    def use_traced_unsharded_params(self, regather_in_backward: bool) -> None:
        for group in self.groups:
            group.use_traced_unsharded_params(regather_in_backward)

    def reshard_after_forward(self) -> None:
        for group in self.groups:
            group.reshard_after_forward()

    def reshard(self, keep_post_forward_shard: bool = False) -> None:
        for group in self.groups:
            group.reshard(keep_post_forward_shard)

    def reset(self) -> None:
        for group in self.groups:
            group.reset()
