"""``__torch_dispatch__`` for DTensor: one path, in three separate stages.

(a) **Read.**  The op, the input specs (DTensors replaced by their ``_spec``) and the non-tensor
    arguments form a hashable key (``_decision_pipeline.call_key``'s); the local tensors are collected
    alongside.  A flat loop reads the common call (positional DTensors, Python scalars, ints,
    strings, dtypes, floats, bools, int lists: no pytree, no recursion, no per-call closure);
    :func:`_read_nested` reads the rest (kwargs such as ``out=``, tensor lists, plain tensors: 0-dim
    ones always, others under ``implicit_replication``).
(b) **Decision.**  One lookup in the one memo; on a miss the reader's values become one
    ``_decision_pipeline.Call`` and the pipeline's walk (``decide``) stores its answer once: a plain-data
    :class:`OpDecision`, or an ``Algorithm`` ("run this": a handler, a decomposition) run on the DTensors.
(c) **Execution.**  A simple decision runs the op on the locals and wraps one tensor (inline: nearly
    every op of a training step); any other goes through :func:`_execute` (redistribution of the
    inputs whose target differs, argument overrides, the random plan, wrapping).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Hashable, Sequence, cast

import torch
from shardwise.mesh import DeviceMesh
from shardwise.placement import DTensorSpec, Replicate, TensorMeta

from ._caches import RANK_CACHES, SHARED_CACHES
from ._decision import WRAP_INPLACE, WRAP_NESTED, WRAP_OUT, WRAP_PASSTHROUGH, WRAP_TENSOR, OpDecision
from ._decision_pipeline import (
    ASKED_EVERY_CALL,
    DISPATCH_LOOKUPS,
    SELF_KEYED_TYPES,
    Algorithm,
    Call,
    Handled,
    ask_every_call,
    call_key,
    decide,
    propagate_op_sharding,
    run_algorithm,
)
from ._dtensor import DTensor
from ._implicit_replication import is_implicit_replication_enabled
from ._shard_rng import run_random_op
from . import _explicit_redistribution as explicit_redistribution
from ._planner import redistribute_cost_bytes
from ._plan_executor import redistribute_local_tensor
from ._wrapper import wrap_local_tensor

__all__ = ["torch_dispatch"]

_Tensor = torch.Tensor
_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
_TYPE_TAGGED_TYPES: frozenset[type] = frozenset({float, bool, complex})
# Ops that read only their tensors' shapes: a plain tensor beside a DTensor is compared by its own
# shape (as replicated), as PyTorch answers them; no values are mixed, so no implicit replication is needed.
_SHAPE_ONLY_OPS: frozenset[Any] = frozenset({torch.ops.aten.is_same_size.default})




def _replicated_spec_for_plain_tensor(
    op: torch._ops.OpOverload, tensor: torch.Tensor, mesh: DeviceMesh
) -> DTensorSpec[DeviceMesh]:
    if tensor.ndim == 0:
        # Python scalars reach aten as 0-dim "wrapped number" tensors: always fine, always replicated.
        cache_key = (mesh, tensor.dtype)
        spec = SHARED_CACHES.scalar_specs.get(cache_key)
        if spec is None:
            spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, TensorMeta(torch.Size(()), (), tensor.dtype))
            SHARED_CACHES.scalar_specs[cache_key] = spec
        return spec
    if not is_implicit_replication_enabled() and op not in _SHAPE_ONLY_OPS:
        if tensor.numel() == 1:
            warnings.warn(
                f"{op}: a plain torch.Tensor of shape {tuple(tensor.shape)} (one element) is used with DTensors; "
                "treating it as replicated. Use a 0-dim tensor or a DTensor to make this explicit.",
                UserWarning,
                stacklevel=3,
            )
        else:
            raise RuntimeError(
                f"{op}: got mixed torch.Tensor and DTensor arguments (a torch.Tensor of shape "
                f"{tuple(tensor.shape)}); convert every torch.Tensor to a DTensor first with "
                "distribute_tensor(...) or DTensor.from_local(...), or run the op inside "
                "implicit_replication() to treat plain tensors as replicated"
            )
    return DTensorSpec(mesh, (Replicate(),) * mesh.ndim, TensorMeta(tensor.shape, tensor.stride(), tensor.dtype))


# -- stage (c) helpers ----------------------------------------------------------------


def _wrap_nested(op: torch._ops.OpOverload, result: Any, specs: Any) -> Any:
    if isinstance(result, _Tensor):
        if isinstance(specs, DTensorSpec):
            return wrap_local_tensor(DTensor, result, specs)
        raise RuntimeError(
            f"{op}: the op returned a tensor but its sharding rule gave {specs!r} instead of a DTensorSpec"
        )
    if isinstance(result, (tuple, list)):
        if not isinstance(specs, (tuple, list)) or len(specs) != len(result):
            raise RuntimeError(
                f"{op}: the op returned {len(result)} outputs but its sharding rule gave output specs {specs!r}"
            )
        wrapped = [_wrap_nested(op, item, spec) for item, spec in zip(result, specs)]
        return tuple(wrapped) if isinstance(result, tuple) else wrapped
    return result


def _adopt_spec(op: torch._ops.OpOverload, target: DTensor, spec: DTensorSpec[DeviceMesh] | None) -> None:
    if spec is None or spec == target._spec:
        return
    meta = spec.tensor_meta
    if meta is None or meta.shape != target.shape:
        raise RuntimeError(
            f"{op}: the sharding rule gives the mutated tensor the spec {spec!r}, which changes its global "
            f"shape {tuple(target.shape)}; a DTensor written in place keeps its shape"
        )
    target._spec = spec


def _check_explicit(prepared: OpDecision, location: int | str, current: DTensorSpec[DeviceMesh], target: DTensorSpec[DeviceMesh]) -> None:
    explicit_redistribution.check_implicit_redistribution(
        lambda: f"{prepared.op} needs input {location} moved from {current.placements} to {target.placements}",
        lambda: redistribute_cost_bytes(current, target) > 0,
    )


def _refuse_mutated_redistribute(
    prepared: OpDecision, location: int | str, current: DTensorSpec[DeviceMesh], target: DTensorSpec[DeviceMesh]
) -> None:
    if location in prepared.written:
        raise RuntimeError(
            f"{prepared.op}: its sharding rule needs the argument it writes into ({location!r}) moved from "
            f"placements {current.placements} to {target.placements}, which an in-place or out= op cannot do "
            "(in-place operations that require placement changes are not supported); "
            f"redistribute that DTensor to {target.placements} first (or use the out-of-place op)"
        )


def _finish(prepared: OpDecision, result: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    kind = prepared.wrap_kind
    if kind == WRAP_TENSOR:
        wrapped = wrap_local_tensor(DTensor, result, prepared.output_spec)  # type: ignore[arg-type]
        if prepared.views_first_argument and args and isinstance(args[0], DTensor):
            if prepared.input_specs[0] != args[0]._spec or _is_moved_view(args[0]):
                _mark_moved_view(wrapped)
        return wrapped
    if kind == WRAP_NESTED:
        return _wrap_nested(prepared.op, result, prepared.output_specs)  # type: ignore[arg-type]
    if kind == WRAP_PASSTHROUGH:
        if isinstance(result, _Tensor):
            raise RuntimeError(f"{prepared.op}: the op returned a tensor but its sharding rule gave no output spec")
        return result
    if kind == WRAP_INPLACE:
        target = args[0]
        if isinstance(target, DTensor):
            _adopt_spec(prepared.op, target, prepared.output_spec)  # type: ignore[arg-type]
        return target
    if kind == WRAP_OUT:
        outs = [kwargs[name] for name in prepared.out_names]
        specs = prepared.output_specs
        spec_list: Sequence[Any] = specs if isinstance(specs, (tuple, list)) else (specs,)
        for out, spec in zip(outs, spec_list):
            if isinstance(out, DTensor):
                _adopt_spec(prepared.op, out, spec)  # type: ignore[arg-type]
        return outs[0] if len(outs) == 1 else tuple(outs)
    return None


# -- views of redistributed inputs ---------------------------------------------------------------------

# A view op whose input had to be redistributed returns a view of a *copy*: writing into it in place cannot
# reach the DTensor it was taken from.  Such results are marked (and views of them, as they are taken), and
# an in-place or out= write into a marked DTensor raises instead of being silently lost.  Views below
# autograd carry no ``_base``, so the mark lives on the DTensor.  The count of marked DTensors still alive
# lets dispatch skip all of this (and keep the C++ hit) while there is none: the usual training step, and
# again once the few marked views of an earlier step are freed.
_MOVED_VIEW_MARK = "_shardwise_views_a_redistributed_copy"
_moved_view_copies = 0


def _forget_moved_view() -> None:
    global _moved_view_copies
    _moved_view_copies -= 1


def _mark_moved_view(result: Any) -> None:
    global _moved_view_copies
    if isinstance(result, DTensor) and not getattr(result, _MOVED_VIEW_MARK, False):
        setattr(result, _MOVED_VIEW_MARK, True)
        _moved_view_copies += 1
        weakref.finalize(result, _forget_moved_view)


def _is_moved_view(value: Any) -> bool:
    return isinstance(value, DTensor) and bool(getattr(value, _MOVED_VIEW_MARK, False))


def _refuse_writes_into_moved_views(prepared: OpDecision, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    for location in prepared.written:
        value = args[location] if isinstance(location, int) and location < len(args) else kwargs.get(str(location))
        values = value if isinstance(value, (list, tuple)) else (value,)
        if any(_is_moved_view(item) for item in values):
            raise RuntimeError(
                f"{prepared.op} writes in place into a view of a DTensor whose view op had to redistribute its "
                "input: the view holds a redistributed copy, so the write could not reach the original DTensor. "
                "Redistribute the DTensor to placements the view keeps (e.g. Replicate()) before taking the view, "
                "or write out of place"
            )


def _check_input_count(prepared: OpDecision, count: int) -> None:
    if len(prepared.input_specs) != count:
        raise RuntimeError(
            f"{prepared.op}: the sharding rule gave {len(prepared.input_specs)} target input specs for "
            f"{count} tensor arguments"
        )


# -- the entry point -----------------------------------------------------------------------


def torch_dispatch(
    cls: type,
    func: torch._ops.OpOverload,
    types: tuple[type, ...],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> Any:
    """``DTensor.__torch_dispatch__``: run ``func`` on DTensors (the one path every op takes).

    Read the call (key, specs, local tensors), look the decision up once, on a miss ask the decision
    pipeline, then execute.  Reading has a flat loop for the common call (positional DTensors, 0-dim
    plain tensors, ints, strings, dtypes, floats, bools, lists of ints) and :func:`_read_nested` for
    the rest; both give the key ``_decision_pipeline.call_key`` defines.
    """
    if ASKED_EVERY_CALL and id(func) in ASKED_EVERY_CALL:  # a handler of this op is not cacheable
        handled = ask_every_call(Call(func, args, kwargs or {}, (), {}))
        if handled is not None:
            return handled.result
    spec_kwargs: dict[str, Any] = _NO_KWARGS
    local_kwargs: dict[str, Any] = _NO_KWARGS
    if kwargs:
        key, spec_args, local_args, spec_kwargs, local_kwargs = _read_nested(func, args, kwargs)
    else:
        local_args = list(args)
        spec_args = list(args)
        tagged_positions: list[int] | None = None
        scalar_positions: list[int] | None = None
        nested = False
        position = 0
        for arg in args:
            arg_type = type(arg)
            if arg_type is DTensor:
                local_args[position] = arg._local_tensor
                spec_args[position] = arg._spec
            elif arg_type in SELF_KEYED_TYPES:
                pass
            elif arg_type in _TYPE_TAGGED_TYPES or arg_type is list:
                if arg_type is list:
                    for item in arg:
                        if type(item) is not int:
                            nested = True
                            break
                if tagged_positions is None:
                    tagged_positions = [position]
                else:
                    tagged_positions.append(position)
            elif arg_type is _Tensor and arg.dim() == 0:
                if scalar_positions is None:
                    scalar_positions = [position]
                else:
                    scalar_positions.append(position)
            else:
                nested = True
            if nested:
                break
            position += 1
        if nested:
            key, spec_args, local_args, spec_kwargs, local_kwargs = _read_nested(func, args, {})
        else:
            if scalar_positions is not None:
                mesh = _find_mesh(args)
                if mesh is None:
                    raise RuntimeError(f"{func}: DTensor dispatch was called without any DTensor argument")
                for position in scalar_positions:
                    spec_args[position] = _replicated_spec_for_plain_tensor(func, args[position], mesh)
            if tagged_positions is not None:
                key = call_key(func, spec_args)
            else:
                # Every part is its own key part (specs, self-keyed values): call_key's value, built inline.
                key = (func, *spec_args)
    prepared: Any  # an OpDecision, or a memoised Algorithm (not simple)
    try:
        found = RANK_CACHES.decisions.get(key)
    except TypeError:
        # Symbolic (SymInt) sizes while torch.compile traces: unhashable, so decided afresh (free in eager).
        found = None
    if found is None:
        DISPATCH_LOOKUPS[1] += 1  # a miss
        mesh = _find_mesh(args) if not kwargs else _find_mesh((args, tuple(kwargs.values())))
        if mesh is not None and mesh.get_coordinate() is None:
            # Never cached, so every call of a rank outside the mesh comes here (and only those).
            return _outside_mesh(func, mesh, args, kwargs or {}, spec_args, spec_kwargs)
        call = Call(func, args, kwargs or {}, spec_args, spec_kwargs, local_args, local_kwargs, key)
        decided = decide(call)
        if type(decided) is Handled:
            return decided.result
        prepared = decided
    else:
        prepared = found
        call = None
        DISPATCH_LOOKUPS[0] += 1  # a hit
    if prepared.simple and not local_kwargs:
        # The common hit: run and wrap one tensor (wrap_result's WRAP_TENSOR branch, inlined: it runs for
        # nearly every op of a training step and the call costs ~0.2 µs, bench_dispatch_overhead).
        result = prepared.call(*local_args)
        wrapped = _make_wrapper_subclass(
            DTensor,
            prepared.output_shape,
            prepared.output_stride,
            None,
            None,
            result.dtype,
            result.layout,
            result.device,
        )
        wrapped._local_tensor = result
        wrapped._spec = prepared.output_spec
        if _moved_view_copies and prepared.views_first_argument and _is_moved_view(args[0]):
            _mark_moved_view(wrapped)
        return wrapped
    if call is None:  # a hit that is not the simple one: the call as one object, built once
        call = Call(func, args, kwargs or {}, spec_args, spec_kwargs, local_args, local_kwargs, key)
    if type(prepared) is Algorithm:  # "run this algorithm", memoised: a handler, a decomposition
        ran = run_algorithm(prepared, call)
        if type(ran) is Handled:
            return ran.result
        prepared = ran
    return _execute(prepared, call)


_NO_KWARGS: dict[str, Any] = {}


def _execute(prepared: OpDecision, call: Call) -> Any:
    """Stage (c) for every decision but the simple one: moved-view check, redistribution of the inputs
    whose target differs (in place in ``call``'s local arguments), argument overrides, the local call
    (through the random plan if any), wrapping."""
    args, kwargs = call.args, call.kwargs
    local_args, local_kwargs = call.local_args, call.local_kwargs
    assert args is not None and kwargs is not None and local_args is not None and local_kwargs is not None
    if _moved_view_copies and prepared.written:
        _refuse_writes_into_moved_views(prepared, args, kwargs)
    if prepared.needs_redistribute:
        # Slots in flattened order: positional args (into lists), then kwargs.
        slots: list[tuple[Any, Any, DTensorSpec[DeviceMesh], int | str]] = []
        for position, spec_value in enumerate(call.spec_args):
            _collect_slots(spec_value, local_args, position, position, slots)
        for name, spec_value in call.spec_kwargs.items():
            _collect_slots(spec_value, local_kwargs, name, name, slots)
        _check_input_count(prepared, len(slots))
        for (container, index, current, location), target in zip(slots, prepared.input_specs):
            if target != current:
                _refuse_mutated_redistribute(prepared, location, current, target)
                if explicit_redistribution.is_active():
                    _check_explicit(prepared, location, current, target)
                container[index] = redistribute_local_tensor(container[index], current, target)
    if prepared.local_arg_overrides:
        if local_kwargs is _NO_KWARGS:
            local_kwargs = {}
        for where, value in prepared.local_arg_overrides:
            if isinstance(where, int):
                local_args[where] = value
            else:
                local_kwargs[where] = value
    if prepared.random_plan is not None:
        result = run_random_op(prepared.random_plan, prepared.call, local_args, local_kwargs)  # type: ignore[arg-type]
    else:
        result = prepared.call(*local_args, **local_kwargs)  # type: ignore[misc]
    return _finish(prepared, result, args, kwargs)


class _ArgConverter:
    """The general path's view of one call: DTensors and accepted plain tensors become specs."""

    __slots__ = ("mesh", "op")

    def __init__(self, op: torch._ops.OpOverload, mesh: DeviceMesh) -> None:
        self.op = op
        self.mesh = mesh

    def convert(self, value: Any) -> tuple[Any, Any]:
        """(value for the rules, value for the local op)."""
        if isinstance(value, DTensor):
            return value._spec, value._local_tensor
        if isinstance(value, _Tensor):
            return _replicated_spec_for_plain_tensor(self.op, value, self.mesh), value
        value_type = type(value)
        if value_type is list or value_type is tuple:
            spec_items = []
            local_items = []
            for item in value:
                spec_item, local_item = self.convert(item)
                spec_items.append(spec_item)
                local_items.append(local_item)
            # Locals are always a list so that redistribution can replace items in place.
            return (tuple(spec_items) if value_type is tuple else spec_items), local_items
        return value, value


def _outside_mesh(
    func: torch._ops.OpOverload,
    mesh: DeviceMesh,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    spec_args: list[Any],
    spec_kwargs: dict[str, Any],
) -> Any:
    """The result on a rank outside the DTensors' mesh: it holds no data and runs nothing (as PyTorch).

    Tensor results are DTensors of the right global shape and dtype holding ``tensor([])`` (a 0-d
    result: ``tensor(0)``); an in-place op returns its input; a bool result (``aten.equal``) is True,
    since this rank holds no element that differs. Shapes and dtypes come from running the op on
    meta tensors of the global shapes; placements from the op's rule when it has one.
    """
    returns = func._schema.returns
    if returns and returns[0].alias_info is not None and returns[0].alias_info.is_write:
        return args[0]
    if len(returns) == 1 and str(returns[0].type) == "bool":
        return True

    def as_meta(value: Any) -> Any:
        if isinstance(value, DTensor):
            spec = value._spec
            return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")
        if type(value) is list or type(value) is tuple:
            return type(value)(as_meta(item) for item in value)
        return value

    with torch.no_grad():
        meta_result = func(*as_meta(args), **{name: as_meta(value) for name, value in kwargs.items()})
    try:
        output_specs: Any = propagate_op_sharding(func, spec_args, spec_kwargs).output_specs
    except (NotImplementedError, RuntimeError, ValueError):
        output_specs = None  # no rule (or none fits): the result is only a placeholder here anyway

    flat_specs = list(output_specs) if isinstance(output_specs, (tuple, list)) else [output_specs]
    index = 0

    def wrap(value: Any) -> Any:
        nonlocal index
        if isinstance(value, torch.Tensor):
            spec = flat_specs[index] if index < len(flat_specs) else None
            index += 1
            placements = spec.placements if isinstance(spec, DTensorSpec) else (Replicate(),) * mesh.ndim
            meta = TensorMeta(value.shape, tuple(value.stride()), value.dtype)
            local = torch.zeros((), dtype=value.dtype) if value.dim() == 0 else torch.empty(0, dtype=value.dtype)
            return wrap_local_tensor(DTensor, local, DTensorSpec(mesh, placements, meta))
        if type(value) is list or type(value) is tuple:
            return type(value)(wrap(item) for item in value)
        return value

    return wrap(meta_result)


def _find_mesh(values: Any) -> DeviceMesh | None:
    for value in values:
        if isinstance(value, DTensor):
            return value._spec.mesh
        if type(value) is list or type(value) is tuple:
            mesh = _find_mesh(value)
            if mesh is not None:
                return mesh
    return None


def _collect_slots(
    spec_value: Any,
    container: Any,
    index: Any,
    location: int | str,
    slots: list[tuple[Any, Any, DTensorSpec[DeviceMesh], int | str]],
) -> None:
    if isinstance(spec_value, DTensorSpec):
        slots.append((container, index, spec_value, location))
    elif isinstance(spec_value, (list, tuple)):
        local_items = container[index]
        for item_index, item in enumerate(spec_value):
            _collect_slots(item, local_items, item_index, location, slots)


def _read_nested(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Hashable, list[Any], list[Any], dict[str, Any], dict[str, Any]]:
    """The call read whatever its arguments hold (kwargs, tensor lists, plain tensors): its key
    (``call_key``'s), specs and local values, positional then keyword."""
    mesh = _find_mesh(args)
    if mesh is None:
        mesh = _find_mesh(kwargs.values())
    if mesh is None:
        raise RuntimeError(f"{func}: DTensor dispatch was called without any DTensor argument")
    converter = _ArgConverter(func, mesh)
    spec_args: list[Any] = []
    local_args: list[Any] = []
    for arg in args:
        spec_value, local_value = converter.convert(arg)
        spec_args.append(spec_value)
        local_args.append(local_value)
    spec_kwargs: dict[str, Any] = {}
    local_kwargs: dict[str, Any] = {}
    for name, value in kwargs.items():
        spec_value, local_value = converter.convert(value)
        spec_kwargs[name] = spec_value
        local_kwargs[name] = local_value
    return call_key(func, spec_args, spec_kwargs), spec_args, local_args, spec_kwargs, local_kwargs
