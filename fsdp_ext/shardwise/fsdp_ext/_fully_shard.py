"""``fully_shard``: PyTorch FSDP2's API on shardwise DTensors.

A unit is one module given to ``fully_shard``: its parameters that no inner unit manages.
Its forward pre-hook all-gathers them (one collective, see ``_param_group``) and starts the
next unit's all-gather (prefetch); its forward hook frees them again (``reshard_after_forward``)
and hooks the outputs so that backward gathers them once more before the unit's backward.  The
unit's gradients are reduce-scattered by the autograd function that produced the unsharded
parameters, once per unit.  The root unit (the outermost one whose forward runs) keeps its
parameters after forward, as PyTorch does (backward needs them right away), and at the end of
backward frees whatever is still unsharded.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map_only

from shardwise.dtensor_ops import DTensor
from shardwise.mesh import DeviceMesh, init_device_mesh
from shardwise.placement import DTensorSpec, Replicate, Shard

from ._errors import FSDPError
from ._mesh_info import FSDPMeshInfo, ShardPlacementFnResult, ShardPlacementResult, _check_dp_mesh_dims, _dp_mesh_of
from ._param_group import FSDPParamGroup, FSDPParamGroups, ParamOwner, SpmdLayout
from ._spmd_annotations import is_annotated, plain_layout
from ._policies import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]

_STATE_ATTR = "_shardwise_fsdp_state"


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather."""

    def __init__(self, group: FSDPParamGroup | FSDPParamGroups | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_unshard()
            self._group = None


class _FSDPState:
    """Everything ``fully_shard`` keeps for one unit (stored on each of its modules, outside their parameters).

    A unit is one module, or several given together as a list: their parameters are gathered
    together when the first of them starts its forward and freed once all of them finished theirs.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        mesh: DeviceMesh,
        group: FSDPParamGroup | FSDPParamGroups | None,
        reshard_after_forward: bool,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules
        self.mesh = mesh
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.is_root: bool | None = None
        self.root: _FSDPState | None = None
        # Root only.
        self.units: list[_FSDPState] = []
        self.forward_order: list[_FSDPState] = []
        self.recording_order = False
        self.backward_callback_queued = False
        # Per unit.
        self.forward_prefetch: list[_FSDPState] | None = None
        self.backward_prefetch: list[_FSDPState] | None = None
        self.pre_backward_done = False
        # From this unit's pre-backward hook to the end of backward: a forward of the unit now is activation
        # checkpointing recomputing it, with the unsharded parameters the pre-backward hook put in place.
        self.in_backward = False
        # Whether the modules hold the unsharded parameters of the unit forward in progress (the autograd
        # function's outputs): a list unit's later modules compute with them, unless a backward in between
        # (torchtitan's chunked loss: lm_head forward and backward per chunk while the final norm of the same
        # unit ran once) swapped them out.
        self.forward_params_in_place = False
        self.is_last_backward = True
        # set_unshard_in_backward(False): backward needs no unsharded parameter of this unit (an embedding).
        self.unshard_in_backward = True
        # set_symm_mem_for_comm: recorded only (no symmetric-memory buffers here).
        self.symm_mem_backend: str | None = None
        # The unit's modules whose forward has not finished yet in the current unit forward (ids).
        self.modules_to_run: set[int] = set()
        # While dynamo traces: how many of the unit's modules are inside their forward (a count,
        # not ids; a list unit's modules run one after the other, so each gathers for itself).
        self.traced_modules_running = 0

    # -- lazy initialisation at the first forward ---------------------------------

    def lazy_init(self) -> None:
        self.is_root = True
        self.root = self
        self.units = []
        for submodule in (m for module in self.modules for m in module.modules()):
            state = _state_of(submodule)
            if state is None or state in self.units:
                continue
            if state is not self:
                state.is_root = False
                state.root = self
                state.units = []
            if state.group is not None:
                state.group.check_materialized()
            self.units.append(state)
        self.forward_order = []
        self.recording_order = True

    def check_params_unchanged(self) -> None:
        group = self.group
        if group is None:
            return
        for fsdp_param in group.fsdp_params:
            for owner in fsdp_param.owners:
                current = owner.module._parameters.get(owner.name)
                if current is not fsdp_param.sharded_param:
                    raise FSDPError(
                        f"fully_shard: parameter {fsdp_param.fqn!r} was replaced after fully_shard (by "
                        f"{type(current).__name__}{' on ' + repr(current.placements) if isinstance(current, DTensor) else ''}); "
                        "expected the sharded DTensor parameter fully_shard registered. Apply tensor parallelism "
                        "(parallelize_module) before fully_shard, not after"
                    )

    # -- forward --------------------------------------------------------------------

    def module_pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Forward pre-hook of each of the unit's modules: the first one to run starts the unit's forward.

        While dynamo traces, the traced path; otherwise the eager one, which dynamo never compiles on its
        own (after a graph break it would compile pieces of it: storage resizing, hooks on outputs).
        """
        if torch.compiler.is_compiling():
            return self.traced_module_pre_forward(module, args, kwargs)
        return self._eager_module_pre_forward(module, args, kwargs)

    @torch._disable_dynamo  # lazy: FSDP2 is imported while torch._dynamo itself imports (switch on)
    def _eager_module_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any]:
        if self.modules_to_run or self.in_backward:
            # Another module of a unit already gathered, or a recomputation in backward (nothing to gather,
            # prefetch or hook: the forward it replays did that).
            group = self.group
            if not self.in_backward and not self.forward_params_in_place and group is not None:
                group.wait_unshard()
                group.use_unsharded_params()
                self.forward_params_in_place = True
            param_dtype = self.mp_policy.param_dtype
            if self.mp_policy.cast_forward_inputs and param_dtype is not None:
                args, kwargs = _cast_floating((args, kwargs), param_dtype)
            return args, kwargs
        self.modules_to_run = {id(m) for m in self.modules}
        return self.pre_forward(module, args, kwargs)

    def module_post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Forward hook of each of the unit's modules: the last one to finish ends the unit's forward.

        It follows the path the pre-hook took (the two may be compiled apart after a graph break).
        """
        if self.traced_modules_running:
            return self.traced_module_post_forward(module, output)
        return self._eager_module_post_forward(module, args, output)

    @torch._disable_dynamo  # lazy: FSDP2 is imported while torch._dynamo itself imports (switch on)
    def _eager_module_post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self.in_backward:
            # Recomputed in backward: the unsharded parameters stay until the unit's post-backward.
            output_dtype = self.mp_policy.output_dtype
            return _cast_floating(output, output_dtype) if output_dtype is not None else output
        self.modules_to_run.discard(id(module))
        if not self.modules_to_run:
            return self.post_forward(module, args, output)
        if torch.is_grad_enabled():
            self._hook_outputs_for_backward(output)
        output_dtype = self.mp_policy.output_dtype
        return _cast_floating(output, output_dtype) if output_dtype is not None else output

    def _hook_outputs_for_backward(self, output: Any) -> None:
        self.pre_backward_done = False
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._pre_backward_hook)

    def pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        if self.is_root is None:
            self.lazy_init()
            for unit in self.units:
                unit.check_params_unchanged()
        root = self.root
        assert root is not None
        if self.is_root:
            # A new forward: shares kept for a backward that never came may be out of date.
            for unit in self.units:
                if unit.group is not None and not unit.group.is_unsharded:
                    unit.group.drop_post_forward_shard()
        if root.recording_order and self.group is not None and self not in root.forward_order:
            root.forward_order.append(self)
        param_dtype = self.mp_policy.param_dtype
        if self.mp_policy.cast_forward_inputs and param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), param_dtype)
        group = self.group
        if group is not None:
            group.wait_unshard()
            for unit in self._forward_prefetch_targets():
                if unit.group is not None:
                    unit.group.launch_unshard()
            group.use_unsharded_params()
            self.forward_params_in_place = True
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        group = self.group
        grad_enabled = torch.is_grad_enabled()
        if group is not None:
            group.use_sharded_params()
            self.forward_params_in_place = False
            if not grad_enabled:
                group.reshard()
            elif self.reshard_after_forward and not self.is_root:
                group.reshard_after_forward()
        if self.is_root:
            self.recording_order = False
        if grad_enabled:
            self._hook_outputs_for_backward(output)
        output_dtype = self.mp_policy.output_dtype
        if output_dtype is not None:
            output = _cast_floating(output, output_dtype)
        return output

    # -- forward inside a compiled graph ----------------------------------------------

    def traced_module_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any]:
        """The pre-hook while dynamo traces: unsharded parameters from traceable DTensor ops, no bookkeeping.

        The all-gather and, through autograd, the reduce-scatter become graph ops (see
        ``FSDPParamGroup.use_traced_unsharded_params``); prefetching, resharding and backward hooks
        are the graph's business (its scheduler and partitioner), so none of them runs here.
        """
        param_dtype = self.mp_policy.param_dtype
        if self.mp_policy.cast_forward_inputs and param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), param_dtype)
        if self.traced_modules_running == 0:
            self.check_params_unchanged()
            # The outermost unit running is the root, which keeps its parameters for backward (as in eager).
            is_root = _TRACED_UNITS.running == 0
            _TRACED_UNITS.running += 1
            if self.group is not None:
                self.group.use_traced_unsharded_params(regather_in_backward=self.reshard_after_forward and not is_root)
        self.traced_modules_running += 1
        return args, kwargs

    def traced_module_post_forward(self, module: nn.Module, output: Any) -> Any:
        """The forward hook while dynamo traces: the sharded parameters back once the unit's last module ran."""
        self.traced_modules_running -= 1
        if self.traced_modules_running == 0:
            _TRACED_UNITS.running -= 1
            if self.group is not None:
                self.group.use_sharded_params()
        output_dtype = self.mp_policy.output_dtype
        return _cast_floating(output, output_dtype) if output_dtype is not None else output

    def _forward_prefetch_targets(self) -> list[_FSDPState]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        root = self.root
        assert root is not None
        if root.recording_order or self not in root.forward_order:
            return []
        index = root.forward_order.index(self)
        return root.forward_order[index + 1 : index + 2]

    # -- backward -------------------------------------------------------------------

    def _pre_backward_hook(self, grad: torch.Tensor) -> torch.Tensor:
        if self.pre_backward_done:
            return grad
        self.pre_backward_done = True
        root = self.root
        assert root is not None
        if not root.backward_callback_queued:
            root.backward_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root._end_of_backward)
        if self.group is not None and self.unshard_in_backward:
            self.group.wait_unshard()
            # The modules compute with the unsharded parameters during the unit's backward, as in PyTorch's
            # FSDP2: activation checkpointing's recomputation (checkpoint_wrapper inside the unit, whose
            # forward hooks do not run again) reads them there. The unit's post-backward (or the end of
            # backward) puts the sharded ones back.
            self.group.use_unsharded_params_in_backward()
        self.in_backward = True
        self.forward_params_in_place = False
        for unit in self._backward_prefetch_targets():
            if unit.group is not None and unit.unshard_in_backward:
                unit.group.launch_unshard()
        return grad

    def _backward_prefetch_targets(self) -> list[_FSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        root = self.root
        assert root is not None
        if self not in root.forward_order:
            return []
        index = root.forward_order.index(self)
        previous = root.forward_order[index - 1 : index] if index > 0 else []
        # The root keeps its parameters after forward: nothing to prefetch for it.
        return [unit for unit in previous if unit.reshard_after_forward and not unit.is_root and unit.unshard_in_backward]

    def _end_of_backward(self) -> None:
        self.backward_callback_queued = False
        for unit in self.units:
            unit.pre_backward_done = False
            unit.in_backward = False
            if unit.group is not None:
                unit.group.use_sharded_params()
                if unit.group.reshard_after_backward:
                    unit.group.reshard()


class _TracedUnits:
    """How many units' forwards enclose the one being traced now (dynamo records the changes and replays
    their net effect, zero, after a successful trace; a failed trace leaves the real count untouched)."""

    def __init__(self) -> None:
        self.running = 0


_TRACED_UNITS = _TracedUnits()


def _state_of(module: nn.Module) -> _FSDPState | None:
    state = module.__dict__.get(_STATE_ATTR)
    return state if isinstance(state, _FSDPState) else None


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor

    return tree_map_only(torch.Tensor, cast, tree)


class FSDPModule:
    """Mixed into the class of every module given to ``fully_shard`` (as PyTorch's ``FSDPModule``)."""

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``nn.Module.compile``; the unit's hooks then stay eager around the compiled forward (see
        ``_register_unit_hooks``)."""
        nn.Module.compile(self, *args, **kwargs)  # type: ignore[arg-type]
        _register_unit_hooks(self, self._fsdp_state())  # type: ignore[arg-type]

    def _fsdp_state(self) -> _FSDPState:
        state = _state_of(self)  # type: ignore[arg-type]
        if state is None:
            raise FSDPError(f"{type(self).__name__} has no fully_shard state")
        return state

    def _fsdp_units(self, recurse: bool) -> list[_FSDPState]:
        if not recurse:
            return [self._fsdp_state()]
        module: nn.Module = self  # type: ignore[assignment]
        units: list[_FSDPState] = []
        for state in (_state_of(m) for m in module.modules()):
            if state is not None and state not in units:
                units.append(state)
        return units

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``nn.Module._apply`` (``to_empty``, ``to``, ...), then this unit's sharded parameters made views of
        its flat buffers again (on the new device, for ``to_empty(device=...)`` after ``fully_shard`` on meta).

        ``_apply`` swaps each parameter's contents in place (``torch.utils.swap_tensors``: the DTensor
        parameter objects, which an optimizer may hold, stay), which leaves their local tensors outside the
        flat buffer the all-gather sends; re-pointing them now makes in-place initialisation afterwards
        (``init_weights``, ``nn.init.*_``, ``copy_``) land in that buffer.
        """
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        state = _state_of(self)  # type: ignore[arg-type]
        if state is not None and state.group is not None:
            # A list unit is re-pointed once its last module moved (until then its parameters are on two devices).
            state.group.reset_sharded_storage()
        return result

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now (the next forward then skips its all-gather)."""
        group = self._fsdp_state().group
        if group is not None:
            group.launch_unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters."""
        group = self._fsdp_state().group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Off: backward accumulates unsharded gradients locally, with no reduce-scatter, until it is on again."""
        for state in self._fsdp_units(recurse):
            if state.group is not None:
                state.group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP, off: backward reduce-scatters within the replica only, keeping the sum for the next
        backward with it on (gradient accumulation with one all-reduce across replicas)."""
        for state in self._fsdp_units(recurse):
            if state.group is not None:
                state.group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for state in self._fsdp_units(recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise FSDPError(f"set_reshard_after_forward expects a bool, got {reshard_after_forward!r}")
        for state in self._fsdp_units(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the reduced gradients by ``factor`` instead of the data-parallel size."""
        if not factor > 0:
            raise FSDPError(f"set_gradient_divide_factor expects a positive factor, got {factor!r}")
        for state in self._fsdp_units(True):
            if state.group is not None:
                state.group.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """PyTorch's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """On: gradients are summed over the data-parallel ranks, not averaged."""
        for state in self._fsdp_units(True):
            if state.group is not None:
                state.group.force_sum_reduction = enable

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook`` with each backward's reduced gradients of this unit (the flat sharded buffer, in
        the reduce dtype, after averaging), where it may change them in place before they are handed
        to the parameters. ``stream`` is refused: there are no side streams here."""
        if stream is not None:
            raise FSDPError("set_all_reduce_hook: shardwise.fsdp_ext runs the hook inline; expected stream=None")
        group = self._fsdp_state().group
        if group is not None:
            group.all_reduce_hook = hook

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: free every unit's unsharded parameters and
        forget the iteration's pending state (gathers, kept shares, unreduced gradients). Root only."""
        state = self._fsdp_state()
        if state.is_root is False:
            raise FSDPError(
                f"reset_iter_state must be called on the root fully_shard module, not on this "
                f"{type(self).__name__}"
            )
        for unit in state.units or [state]:
            unit.pre_backward_done = False
            unit.in_backward = False
            unit.forward_params_in_place = False
            unit.modules_to_run = set()
            if unit.group is not None:
                unit.group.use_sharded_params()
                unit.group.reset()
        state.backward_callback_queued = False
        if state.recording_order:
            # The first forward did not finish: record the unit order again next time.
            state.forward_order = []

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Recorded for PyTorch compatibility: every backward here finishes its own work."""
        for state in self._fsdp_units(True):
            state.is_last_backward = is_last_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Off: this unit's backward does not all-gather its parameters again (for a module whose backward
        reads none of them, e.g. an embedding: its gradients are still reduce-scattered). The unit's own
        setting, as in PyTorch (not recursive)."""
        self._fsdp_state().unshard_in_backward = bool(unshard_in_backward)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted and recorded, with no effect: shardwise.fsdp_ext's collectives use ordinary buffers through
        ``torch.ops._c10d_functional`` (no symmetric memory), whose results are the same."""
        for state in self._fsdp_units(True):
            state.symm_mem_backend = backend

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Replace the default (the next unit in forward order) with these units' all-gathers."""
        self._fsdp_state().forward_prefetch = [_fsdp_module_state(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Replace the default (the previous unit in forward order) with these units' all-gathers."""
        self._fsdp_state().backward_prefetch = [
            _fsdp_module_state(m, "set_modules_to_backward_prefetch") for m in modules
        ]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run like its ``forward`` for FSDP: the unit's parameters are gathered
    before it and freed after it (PyTorch's function of that name). A no-op when ``module`` is not a
    fully_shard module."""
    state = _state_of(module)
    if state is None:
        return
    if not callable(getattr(module, method_name, None)):
        raise FSDPError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    method = getattr(module, method_name)

    def forward_method(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.module_pre_forward(module, args, kwargs)
        output = method(*args, **kwargs)
        return state.module_post_forward(module, args, output)

    forward_method.__name__ = method_name
    forward_method.__doc__ = method.__doc__
    setattr(module, method_name, forward_method)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """PyTorch shares CUDA streams between these FSDP roots; here every collective runs on the caller's
    stream already, so this only checks that they are fully_shard modules."""
    for module in modules:
        _fsdp_module_state(module, "share_comm_ctx")


def _fsdp_module_state(module: object, caller: str) -> _FSDPState:
    state = _state_of(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise FSDPError(f"{caller}: {type(module).__name__} is not a fully_shard module; expected FSDPModules")
    return state


_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    fsdp_cls = _FSDP_CLASSES.get(cls)
    if fsdp_cls is None:
        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
        _FSDP_CLASSES[cls] = fsdp_cls
    return fsdp_cls


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = True,
    shard_placement_fn: Callable[[nn.Parameter], ShardPlacementFnResult] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> Any:
    """Shard ``module``'s parameters over the data-parallel ``mesh`` (PyTorch's ``fully_shard`` API).

    Every parameter of ``module`` that no inner ``fully_shard`` unit manages and that is not in
    ``ignored_params`` becomes a DTensor ``Shard(0)`` over ``mesh`` (on the 2-D mesh of ``mesh`` and
    the tensor-parallel dim when it already was a DTensor; ``_StridedShard`` when both cut dim 0).
    A list of modules makes them one unit (one all-gather, one reduce-scatter): gathered when the
    first of them starts its forward, freed when all of them finished theirs.  Returns ``module``
    (the list, for a list), whose class (each module's) now also derives from :class:`FSDPModule`.
    With ``dp_mesh_dims``, ``mesh`` is the full SPMD mesh and every managed parameter a DTensor on it with
    ``Replicate()`` on the named data-parallel dims: FSDP shards over the ``shard`` dim(s) (several are
    flattened into one), replicates over the ``replicate`` dim(s) (HSDP) and keeps the other dims'
    placements; the module computes with the parameters on the full mesh, as they were.
    Checks everything before any collective.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise FSDPError("fully_shard got an empty list of modules; expected an nn.Module or a non-empty list")
    for each in modules:
        if not isinstance(each, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {type(each).__name__}")
        if _state_of(each) is not None:
            raise FSDPError(
                f"fully_shard was already applied to this {type(each).__name__}; expected one call per module"
            )
        if isinstance(each, (nn.ModuleList, nn.ModuleDict)) and type(each).forward is nn.Module.forward:
            # Its forward never runs, so its hooks would never gather its parameters.
            raise FSDPError(
                f"fully_shard does not support containers that do not implement forward: a {type(each).__name__}; "
                "expected the modules inside it (each its own unit, or a list of them as one unit)"
            )
    if len({id(m) for m in modules}) != len(modules):
        raise FSDPError("fully_shard got the same module twice in its list; expected distinct modules")
    if reshard_after_forward is None:
        reshard_after_forward = True  # PyTorch's default: reshard, except the root (which keeps its parameters here)
    if not isinstance(reshard_after_forward, (bool, int)):
        raise TypeError(
            f"fully_shard: reshard_after_forward must be a bool or an int, got {type(reshard_after_forward).__name__}"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    managed = _managed_params(modules, ignored_params or set())
    device_type = managed[0][1].device.type if managed else "cpu"
    if device_type == "meta":
        # Deferred initialisation: the parameters will be materialised on the default device (to_empty).
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device_type = accelerator.type if accelerator is not None else "cpu"
    if isinstance(offload_policy, CPUOffloadPolicy) and device_type != "cpu":
        raise NotImplementedError(
            f"fully_shard: CPUOffloadPolicy on a {device_type!r} mesh is not supported by shardwise.fsdp_ext; "
            "expected OffloadPolicy() (on a CPU mesh the parameters already live in CPU memory)"
        )
    if mesh is None:
        if dp_mesh_dims is not None:
            raise FSDPError("fully_shard: dp_mesh_dims needs mesh= (the full SPMD mesh the parameters live on)")
        mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a shardwise DeviceMesh, got {type(mesh).__name__}")
    if dp_mesh_dims is not None:
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                f"fully_shard: reshard_after_forward={reshard_after_forward} (an int) is not supported with "
                "dp_mesh_dims (a full SPMD mesh), as in PyTorch; expected True or False"
            )
        _check_dp_mesh_dims(mesh, dp_mesh_dims)
    elif mesh.ndim not in (1, 2):
        raise FSDPError(
            f"fully_shard: got a {mesh.ndim}-D mesh {mesh!r}; expected a 1-D data-parallel mesh such as "
            'mesh["dp"], or a 2-D (replicate, shard) mesh for HSDP'
        )
    if mesh.get_coordinate() is None:
        raise FSDPError(f"fully_shard: rank {torch.distributed.get_rank()} is not part of {mesh!r}")
    for fqn, param, _ in managed:
        # Meta parameters (deferred initialisation) are sharded as they are, with no collective; the
        # unit's buffers follow them onto the mesh's device when module.to_empty(device=...) moves them.
        if param.device.type not in (mesh.device_type, "meta"):
            raise FSDPError(
                f"fully_shard: parameter {fqn!r} is on {param.device} but the mesh is a {mesh.device_type!r} mesh; "
                "expected the parameters on the mesh's device type (or on the meta device, to be materialised "
                "later with module.to_empty(device=...))"
            )
    # One parameter group per data-parallel mesh: the default one (key None), and those named by
    # shard_placement_fn's ShardPlacementResults (parameters on equal meshes share a group).
    placements = [_shard_placement(fqn, param, shard_placement_fn) for fqn, param, _ in managed]
    buckets: dict[Any, tuple[FSDPMeshInfo | None, list[int]]] = {}
    for index, (_, mesh_info) in enumerate(placements):
        key = None if mesh_info is None else (mesh_info.mesh, mesh_info.is_spmd_mesh, mesh_info.spmd_mesh)
        buckets.setdefault(key, (mesh_info, []))[1].append(index)
    plans: list[tuple[DeviceMesh | None, list[int], list[SpmdLayout] | None, tuple[bool, int | None]]] = []
    for key, (mesh_info, indices) in buckets.items():
        chosen = [managed[i] for i in indices]
        if mesh_info is None:
            layouts = _spmd_layouts(chosen, mesh, dp_mesh_dims) if dp_mesh_dims is not None else None
            if dp_mesh_dims is None:
                reshard_plan = _check_reshard_after_forward(reshard_after_forward, mesh)
            else:
                reshard_plan = (bool(reshard_after_forward), None)
            plans.append((None, indices, layouts, reshard_plan))  # the default mesh: flattened below if needed
            continue
        if mesh_info.is_spmd_mesh:
            assert mesh_info.spmd_mesh is not None and mesh_info.dp_mesh_dims is not None
            layouts = _spmd_layouts(chosen, mesh_info.spmd_mesh, mesh_info.dp_mesh_dims)
        else:
            layouts = None
        if mesh_info.is_spmd_mesh and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                f"fully_shard: reshard_after_forward={reshard_after_forward} (an int) is not supported with a "
                "mesh info from dp_mesh_dims (a full SPMD mesh), as in PyTorch; expected True or False"
            )
        reshard_plan = _check_reshard_after_forward(reshard_after_forward, mesh_info.mesh)
        plans.append((mesh_info.mesh, indices, layouts, reshard_plan))
    if plans:
        reshard = plans[0][3][0]
    elif dp_mesh_dims is None:
        reshard = _check_reshard_after_forward(reshard_after_forward, mesh)[0]
    else:
        reshard = bool(reshard_after_forward)
    if dp_mesh_dims is not None:
        mesh = _dp_mesh_of(mesh, dp_mesh_dims)  # may flatten dims: creates process groups, after every check
    groups: list[FSDPParamGroup] = []
    for group_mesh, indices, layouts, (_, post_forward_size) in plans:
        dp_mesh = group_mesh if group_mesh is not None else mesh
        group = FSDPParamGroup(
            [managed[i] for i in indices],
            dp_mesh,
            param_dtype=mp_policy.param_dtype,
            reduce_dtype=mp_policy.reduce_dtype,
            shard_dims=[placements[i][0] for i in indices],
            spmd_layouts=layouts,
        )
        if post_forward_size is not None:
            group.set_post_forward_group(_post_forward_mesh(dp_mesh, post_forward_size))
        groups.append(group)
    unit_group: FSDPParamGroup | FSDPParamGroups | None = None
    if len(groups) == 1:
        unit_group = groups[0]
    elif groups:
        unit_group = FSDPParamGroups(groups)
    if unit_group is not None:
        unit_group.make_sharded_params()
    state = _FSDPState(modules, mesh, unit_group, reshard, mp_policy)
    for each in modules:
        each.__dict__[_STATE_ATTR] = state
        _register_unit_hooks(each, state)
        each.__class__ = _fsdp_class(type(each))
    return module


_HOOKS_ATTR = "_shardwise_fsdp_hook_handles"


def _register_unit_hooks(module: nn.Module, state: _FSDPState) -> None:
    """The unit's forward hooks on ``module`` (replacing any it had).

    A module whose own call is compiled (``module.compile()``, torchtitan's per-block compile, before or after
    ``fully_shard``) gets the eager hooks, which dynamo runs outside the module's graph, as PyTorch's FSDP2
    runs its hooks: the graph is the block's forward, FSDP's gathering and bookkeeping stay eager (with every
    option). Otherwise hooks that take the traced path while dynamo traces a larger region (the whole model
    compiled: FSDP's collectives become graph ops) and the eager one otherwise.
    """
    for handle in module.__dict__.pop(_HOOKS_ATTR, ()):
        handle.remove()
    if getattr(module, "_compiled_call_impl", None) is not None:
        pre, post = state._eager_module_pre_forward, state._eager_module_post_forward
    else:
        pre, post = state.module_pre_forward, state.module_post_forward
    module.__dict__[_HOOKS_ATTR] = (
        module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True),
        module.register_forward_hook(post),
    )


def _shard_placement(
    fqn: str, param: nn.Parameter, shard_placement_fn: Callable[[nn.Parameter], ShardPlacementFnResult] | None
) -> tuple[int, FSDPMeshInfo | None]:
    """The dim FSDP cuts ``param`` along (what ``shard_placement_fn`` says, else 0) and the mesh info it
    names, if any (None: the mesh given to fully_shard)."""
    result = shard_placement_fn(param) if shard_placement_fn is not None else None
    mesh_info: FSDPMeshInfo | None = None
    placement: object = result
    if isinstance(result, ShardPlacementResult):
        if not isinstance(result.mesh_info, FSDPMeshInfo):
            raise FSDPError(
                f"fully_shard: shard_placement_fn returned a ShardPlacementResult for {fqn!r} whose mesh_info is a "
                f"{type(result.mesh_info).__name__}; expected an FSDPMeshInfo or HSDPMeshInfo (a mesh with a shard dim)"
            )
        mesh_info, placement = result.mesh_info, result.placement
    if placement is None:
        return 0, mesh_info
    if type(placement) is not Shard:
        raise FSDPError(
            f"fully_shard: shard_placement_fn returned {result!r} for {fqn!r}; expected None or Shard(dim), or a "
            "ShardPlacementResult(Shard(dim) or None, mesh_info)"
        )
    ndim = param.dim()
    if not -ndim <= placement.dim < ndim:
        raise FSDPError(
            f"fully_shard: shard_placement_fn returned {placement!r} for {fqn!r} of shape {tuple(param.shape)}; "
            f"expected a dim in [{-ndim}, {ndim - 1}]"
        )
    return placement.dim % ndim, mesh_info


def _check_reshard_after_forward(value: bool | int, mesh: DeviceMesh) -> tuple[bool, int | None]:
    """(reshard after forward?, the size of the smaller group to keep the parameters sharded over, if any)."""
    if isinstance(value, bool):
        return value, None
    shard_size = mesh.shape[-1]
    if value < 1 or shard_size % value:
        raise FSDPError(
            f"fully_shard: reshard_after_forward={value} does not divide the data-parallel shard size {shard_size} "
            f"of {mesh!r}; expected True, False or a divisor of {shard_size}"
        )
    if value == 1:
        return False, None
    if value == shard_size:
        return True, None
    return True, value


def _post_forward_mesh(mesh: DeviceMesh, size: int) -> tuple[DeviceMesh, int]:
    """A mesh whose dim (returned too) groups ``size`` consecutive ranks of ``mesh``'s shard dim.

    Built over the whole root mesh (the shard dim split in two), so that every rank creates the
    same process groups in the same order, as c10d requires.
    """
    root = mesh._get_root_mesh()
    shard_name = mesh.mesh_dim_names[-1] if mesh.mesh_dim_names else None
    if root is mesh:
        shard_dim = mesh.ndim - 1
    elif shard_name is not None and root.mesh_dim_names and shard_name in root.mesh_dim_names:
        shard_dim = root.mesh_dim_names.index(shard_name)
    else:
        raise FSDPError(
            f"fully_shard: reshard_after_forward={size} needs the data-parallel shard dim of {mesh!r} to be a "
            "named dim of its root mesh (or the mesh to be a root mesh)"
        )
    ranks = root.mesh.unflatten(shard_dim, (root.shape[shard_dim] // size, size))
    return DeviceMesh(mesh.device_type, ranks), shard_dim + 1


def _managed_params(
    modules: list[nn.Module], ignored: Iterable[nn.Parameter]
) -> list[tuple[str, nn.Parameter, list[ParamOwner]]]:
    """Parameters of ``modules`` not managed by an inner unit nor ignored, each with every module slot holding it.

    Names are relative to their module (prefixed by its index in the list when there are several).
    """
    ignored_ids = {id(p) for p in ignored}
    inner_ids: set[int] = set()
    for module in modules:
        for submodule in module.modules():
            state = _state_of(submodule)
            if submodule is not module and state is not None and state.group is not None:
                inner_ids.update(id(p.sharded_param) for p in state.group.fsdp_params)
    found: dict[int, tuple[str, nn.Parameter, list[ParamOwner]]] = {}
    for index, module in enumerate(modules):
        prefix = f"[{index}]." if len(modules) > 1 else ""
        for module_name, submodule in module.named_modules(remove_duplicate=False):
            for name, param in submodule._parameters.items():
                if param is None or id(param) in ignored_ids or id(param) in inner_ids:
                    continue
                entry = found.get(id(param))
                if entry is None:
                    fqn = f"{prefix}{module_name}.{name}" if module_name else f"{prefix}{name}"
                    found[id(param)] = (fqn, param, [ParamOwner(submodule, name)])
                elif all(owner.module is not submodule or owner.name != name for owner in entry[2]):
                    entry[2].append(ParamOwner(submodule, name))
    return list(found.values())


def _spmd_layouts(
    managed: list[tuple[str, nn.Parameter, list[ParamOwner]]], spmd_mesh: DeviceMesh, dims: DataParallelMeshDims
) -> list[SpmdLayout]:
    """Each parameter's layout over the full SPMD mesh, checked (no collective): a DTensor on that mesh,
    Replicate on every data-parallel dim, or a plain piece annotated with per-axis types (spmd_types)."""
    _check_dp_mesh_dims(spmd_mesh, dims)
    names = spmd_mesh.mesh_dim_names
    assert names is not None
    dp_names = (*dims.shard_names, *dims.replicate_names)
    dp_dims = frozenset(names.index(name) for name in dp_names)
    other = tuple(name for name in names if name not in dp_names)
    layouts: list[SpmdLayout] = []
    for fqn, param, _ in managed:
        if not isinstance(param, DTensor) and is_annotated(param):
            compute_spec, plain = plain_layout(fqn, param, spmd_mesh, dp_dims)
            layouts.append(SpmdLayout(_tp_spec_of(compute_spec, spmd_mesh, other, dp_dims), compute_spec, dp_dims, plain))
            continue
        if not isinstance(param, DTensor):
            raise FSDPError(
                f"fully_shard: with dp_mesh_dims every parameter must be a DTensor on the full SPMD mesh "
                f"{spmd_mesh!r} (e.g. via distribute_module) or a plain tensor annotated with per-mesh-axis types "
                f"(spmd_types.assert_type); got a plain tensor without annotation for {fqn!r}"
            )
        if param.device_mesh != spmd_mesh:
            raise FSDPError(
                f"fully_shard: parameter {fqn!r} is a DTensor on {param.device_mesh!r}; with dp_mesh_dims expected "
                f"it on the mesh given to fully_shard, {spmd_mesh!r}"
            )
        spec = param._spec
        for dim in sorted(dp_dims):
            if not isinstance(spec.placements[dim], Replicate):
                raise FSDPError(
                    f"fully_shard: parameter {fqn!r} has {spec.placements[dim]} on the data-parallel mesh dim "
                    f"{names[dim]!r} (placements {spec.placements}); expected Replicate() on every dim of {dims!r}"
                )
        layouts.append(SpmdLayout(_tp_spec_of(spec, spmd_mesh, other, dp_dims), spec, dp_dims))
    return layouts


def _tp_spec_of(
    spec: DTensorSpec[DeviceMesh], spmd_mesh: DeviceMesh, other: tuple[str, ...], dp_dims: frozenset[int]
) -> DTensorSpec[DeviceMesh] | None:
    """The layout over the full mesh's non data-parallel dims (None when it has none)."""
    if not other:
        return None
    placements = tuple(p for dim, p in enumerate(spec.placements) if dim not in dp_dims)
    return DTensorSpec(spmd_mesh[other], placements, spec.tensor_meta)
