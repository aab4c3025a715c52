"""``__torch_dispatch__`` for DTensor, in three separate stages.

(a) **Key.**  The op, the input specs (DTensors replaced by their ``_spec``) and
    the non-tensor arguments form a hashable key.  Specs and placements cache
    their hash, so building the key costs a tuple.
(b) **Decision.**  On a key miss, ``propagate_op_sharding`` (the sharding-rule
    engine) returns a plain-data :class:`OpDecision`; it is stored, together with
    what dispatch derives from the op schema, in a :class:`PreparedOp` (plain
    data, no closures) under the key.
(c) **Execution.**  Inputs whose target spec differs are redistributed, the op
    runs on the local tensors and the outputs are wrapped with the output specs.

The common case (positional DTensors, Python scalars, ints, strings, dtypes and
lists of ints; no kwargs) takes a flat fast path without pytree, recursion or
per-call closures; a cache hit there costs two list copies, one key tuple, one
dict lookup, the local op and one wrapper.  Everything else takes the general
path, which handles nested lists of tensors, kwargs (``out=``), plain tensors
(0-dim ones always, others under :func:`implicit_replication`) and builds keys of
the same shape.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Sequence, cast

import torch
from shardwise.mesh import DeviceMesh
from shardwise.placement import DTensorSpec, Replicate, TensorMeta

from ._dtensor import DTensor
from ._random import RandomPlan, plan_random_op, run_random_op
from ._ops._strategy import builtin_op_handlers, rule_for
from ._redistribute import redistribute_local_tensor
from ._sharding_prop import OpDecision, propagate_op_sharding

__all__ = [
    "torch_dispatch",
    "implicit_replication",
    "is_implicit_replication_enabled",
    "PreparedOp",
    "clear_dispatch_cache",
    "dispatch_cache_size",
    "OpHandler",
    "register_op_handler",
    "unregister_op_handler",
    "custom_op_handlers",
]

_Tensor = torch.Tensor
_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass

# Non-tensor argument types whose value is its own cache key (hash/eq distinguish all values that
# matter).  float/bool/complex are not here: 1 == 1.0 == True, yet they can change the output dtype.
_SELF_KEYED_TYPES: frozenset[type] = frozenset(
    {int, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)
_TYPE_TAGGED_TYPES: frozenset[type] = frozenset({float, bool, complex})

# Wrap kinds: how the local result becomes the op's result.
WRAP_TENSOR = 0  # one tensor output: new DTensor with output_specs
WRAP_NESTED = 1  # tuple/list outputs (or a mix of tensors and non-tensors)
WRAP_PASSTHROUGH = 2  # non-tensor result (bool, scalar, ...): returned as is
WRAP_INPLACE = 3  # in-place op: the mutated DTensor itself
WRAP_OUT = 4  # out= op: the out DTensor(s)
WRAP_NONE = 5  # returns nothing (e.g. _foreach_add_)

_MAX_CACHE_ENTRIES = 1 << 16


class PreparedOp:
    """A cached decision plus what dispatch derives from the op schema (plain data)."""

    __slots__ = (
        "op",
        "call",
        "decision",
        "output_spec",
        "output_shape",
        "output_stride",
        "wrap_kind",
        "needs_redistribute",
        "input_specs",
        "overrides",
        "mutated",
        "out_names",
        "simple",
        "random_plan",
    )

    def __init__(self, op: torch._ops.OpOverload, decision: OpDecision) -> None:
        self.op = op
        # A rule's local kernel replaces the op on the local tensors (e.g. masked lookups in a row-sharded table).
        kernel = decision.local_kernel
        self.call: Callable[..., Any] = getattr(op, "_op", op) if kernel is None else kernel
        self.decision = decision
        self.input_specs: tuple[DTensorSpec[DeviceMesh], ...] = tuple(decision.input_specs)
        self.needs_redistribute: bool = bool(decision.needs_redistribute)
        self.overrides: tuple[tuple[int | str, object], ...] = tuple(decision.local_arg_overrides)
        schema = op._schema
        mutated: set[int | str] = set()
        out_names: list[str] = []
        for position, argument in enumerate(schema.arguments):
            if argument.is_out:
                out_names.append(argument.name)
            alias = argument.alias_info
            if argument.is_out or (alias is not None and alias.is_write):
                mutated.add(argument.name)
                if not argument.kwarg_only:
                    mutated.add(position)
        self.mutated: frozenset[int | str] = frozenset(mutated)
        self.out_names: tuple[str, ...] = tuple(out_names)
        output_specs = decision.output_specs
        self.output_spec: DTensorSpec[DeviceMesh] | None = None
        self.output_shape: torch.Size | None = None
        self.output_stride: tuple[int, ...] | None = None
        first_argument = schema.arguments[0] if schema.arguments else None
        if out_names:
            self.wrap_kind = WRAP_OUT
        elif not schema.returns:
            self.wrap_kind = WRAP_NONE
        elif (
            first_argument is not None
            and first_argument.alias_info is not None
            and first_argument.alias_info.is_write
            and len(schema.returns) == 1
            and schema.returns[0].alias_info is not None
            and schema.returns[0].alias_info.is_write
        ):
            self.wrap_kind = WRAP_INPLACE
        elif isinstance(output_specs, DTensorSpec):
            self.wrap_kind = WRAP_TENSOR
            meta = output_specs.tensor_meta
            if meta is None:
                raise RuntimeError(f"{op}: the sharding rule returned an output spec without tensor_meta: {output_specs!r}")
            self.output_spec = output_specs
            self.output_shape = meta.shape
            self.output_stride = meta.stride
        elif output_specs is None:
            self.wrap_kind = WRAP_PASSTHROUGH
        else:
            self.wrap_kind = WRAP_NESTED
        if self.wrap_kind == WRAP_INPLACE and isinstance(output_specs, DTensorSpec):
            self.output_spec = output_specs
        # The common case, taken without further checks: nothing to move, one tensor to wrap.
        # Ops drawing random values run in this rank's shard stream (see _random); None for every other op.
        self.random_plan: RandomPlan | None = plan_random_op(op, decision)
        self.simple: bool = (
            self.wrap_kind == WRAP_TENSOR
            and not self.needs_redistribute
            and not self.overrides
            and self.random_plan is None
        )


_decision_cache: dict[tuple[Any, ...], PreparedOp] = {}


def clear_dispatch_cache() -> None:
    """Forget every cached decision (tests; after changing sharding rules)."""
    _decision_cache.clear()


def dispatch_cache_size() -> int:
    return len(_decision_cache)


def _prepare(
    op: torch._ops.OpOverload, key: tuple[Any, ...], spec_args: tuple[Any, ...], spec_kwargs: dict[str, Any]
) -> PreparedOp:
    decision = propagate_op_sharding(op, spec_args, spec_kwargs)
    prepared = PreparedOp(op, decision)
    if len(_decision_cache) >= _MAX_CACHE_ENTRIES:
        # Unbounded growth only comes from ever-changing shapes; start over rather than track recency.
        _decision_cache.clear()
    try:
        _decision_cache[key] = prepared
    except TypeError:
        # A non-tensor argument we could not hash: decide every time instead of failing.
        pass
    return prepared


# -- implicit replication --------------------------------------------------------------

_implicit_replication_depth = 0


def is_implicit_replication_enabled() -> bool:
    return _implicit_replication_depth > 0


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside this context a plain ``torch.Tensor`` used with DTensors counts as replicated.

    Every rank must hold the same value for that tensor; nothing checks it.
    """
    global _implicit_replication_depth
    _implicit_replication_depth += 1
    try:
        yield
    finally:
        _implicit_replication_depth -= 1


_scalar_spec_cache: dict[tuple[DeviceMesh, torch.dtype], DTensorSpec[DeviceMesh]] = {}


def _replicated_spec_for_plain_tensor(
    op: torch._ops.OpOverload, tensor: torch.Tensor, mesh: DeviceMesh
) -> DTensorSpec[DeviceMesh]:
    if tensor.ndim == 0:
        # Python scalars reach aten as 0-dim "wrapped number" tensors: always fine, always replicated.
        cache_key = (mesh, tensor.dtype)
        spec = _scalar_spec_cache.get(cache_key)
        if spec is None:
            spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, TensorMeta(torch.Size(()), (), tensor.dtype))
            _scalar_spec_cache[cache_key] = spec
        return spec
    if _implicit_replication_depth == 0:
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


def _wrap_tensor(local: torch.Tensor, spec: DTensorSpec[DeviceMesh]) -> DTensor:
    meta = spec.tensor_meta
    if meta is None:
        raise RuntimeError(f"sharding rule returned an output spec without tensor_meta: {spec!r}")
    result = _make_wrapper_subclass(
        DTensor, meta.shape, meta.stride, None, None, local.dtype, local.layout, local.device
    )
    result._local_tensor = local
    result._spec = spec
    return result


def _wrap_nested(op: torch._ops.OpOverload, result: Any, specs: Any) -> Any:
    if isinstance(result, _Tensor):
        if isinstance(specs, DTensorSpec):
            return _wrap_tensor(result, specs)
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


def _refuse_mutated_redistribute(
    prepared: PreparedOp, location: int | str, current: DTensorSpec[DeviceMesh], target: DTensorSpec[DeviceMesh]
) -> None:
    if location in prepared.mutated:
        raise RuntimeError(
            f"{prepared.op}: its sharding rule needs the argument it writes into ({location!r}) moved from "
            f"placements {current.placements} to {target.placements}, which an in-place or out= op cannot do; "
            f"redistribute that DTensor to {target.placements} first (or use the out-of-place op)"
        )


def _finish(prepared: PreparedOp, result: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    kind = prepared.wrap_kind
    if kind == WRAP_TENSOR:
        spec = cast(DTensorSpec[DeviceMesh], prepared.output_spec)
        return _wrap_tensor(result, spec)
    if kind == WRAP_NESTED:
        return _wrap_nested(prepared.op, result, prepared.decision.output_specs)
    if kind == WRAP_PASSTHROUGH:
        if isinstance(result, _Tensor):
            raise RuntimeError(f"{prepared.op}: the op returned a tensor but its sharding rule gave no output spec")
        return result
    if kind == WRAP_INPLACE:
        target = args[0]
        if isinstance(target, DTensor):
            _adopt_spec(prepared.op, target, prepared.output_spec)
        return target
    if kind == WRAP_OUT:
        outs = [kwargs[name] for name in prepared.out_names]
        specs = prepared.decision.output_specs
        spec_list: Sequence[Any] = specs if isinstance(specs, (tuple, list)) else (specs,)
        for out, spec in zip(outs, spec_list):
            if isinstance(out, DTensor):
                _adopt_spec(prepared.op, out, spec)
        return outs[0] if len(outs) == 1 else tuple(outs)
    return None


def _check_input_count(prepared: PreparedOp, count: int) -> None:
    if len(prepared.input_specs) != count:
        raise RuntimeError(
            f"{prepared.op}: the sharding rule gave {len(prepared.input_specs)} target input specs for "
            f"{count} tensor arguments"
        )


# -- the entry point -----------------------------------------------------------------------


OpHandler = Callable[[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]], Any]

# Ops whose DTensor behaviour is a whole algorithm rather than a sharding rule (e.g. loss_parallel's
# cross-entropy on class-sharded logits). Empty on the common path, so dispatch pays one truthiness test.
_op_handlers: dict[torch._ops.OpOverload, OpHandler] = {}


def register_op_handler(op: torch._ops.OpOverload, handler: OpHandler) -> None:
    """Run ``handler(op, args, kwargs)`` instead of sharding propagation for ``op`` on DTensors.

    The handler gets the original arguments (DTensors untouched) and runs below autograd, like any
    ``__torch_dispatch__`` code. Returning ``NotImplemented`` falls through to the normal path.
    """
    if op in _op_handlers:
        raise ValueError(f"{op} already has a custom DTensor op handler ({_op_handlers[op]!r}); unregister it first")
    _op_handlers[op] = handler


def unregister_op_handler(op: torch._ops.OpOverload) -> None:
    _op_handlers.pop(op, None)


@contextlib.contextmanager
def custom_op_handlers(handlers: dict[torch._ops.OpOverload, OpHandler]) -> Iterator[None]:
    """Register ``handlers`` for the duration of the block (restoring whatever was there before)."""
    previous = {op: _op_handlers[op] for op in handlers if op in _op_handlers}
    for op in previous:
        del _op_handlers[op]
    registered: list[torch._ops.OpOverload] = []
    try:
        for op, handler in handlers.items():
            register_op_handler(op, handler)
            registered.append(op)
        yield
    finally:
        for op in registered:
            unregister_op_handler(op)
        _op_handlers.update(previous)


def torch_dispatch(
    cls: type,
    func: torch._ops.OpOverload,
    types: tuple[type, ...],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> Any:
    """``DTensor.__torch_dispatch__``: run ``func`` on DTensors.

    Flat fast path for positional arguments that are DTensors, 0-dim plain tensors
    (Python scalars), ints/None/strings/dtypes, floats/bools and lists of ints;
    anything else (kwargs, tensor lists, other plain tensors) takes the general path.
    """
    if _op_handlers:
        handler = _op_handlers.get(func)
        if handler is not None:
            result = handler(func, args, kwargs or {})
            if result is not NotImplemented:
                return result
    if kwargs:
        return _dispatch_general(func, args, kwargs)
    local_args = list(args)
    spec_args = list(args)
    freeze_key = False
    scalar_positions: list[int] | None = None
    position = 0
    for arg in args:
        arg_type = type(arg)
        if arg_type is DTensor:
            local_args[position] = arg._local_tensor
            spec_args[position] = arg._spec
        elif arg_type in _SELF_KEYED_TYPES:
            pass
        elif arg_type in _TYPE_TAGGED_TYPES:
            freeze_key = True
        elif arg_type is list:
            for item in arg:
                if type(item) is not int:
                    return _dispatch_general(func, args, {})
            freeze_key = True
        elif arg_type is _Tensor and arg.dim() == 0:
            if scalar_positions is None:
                scalar_positions = [position]
            else:
                scalar_positions.append(position)
        else:
            return _dispatch_general(func, args, {})
        position += 1
    if scalar_positions is not None:
        mesh = _find_mesh(args)
        if mesh is None:
            return _dispatch_general(func, args, {})
        for position in scalar_positions:
            spec_args[position] = _replicated_spec_for_plain_tensor(func, args[position], mesh)
    if freeze_key:
        keep_floats = _float_values_matter(func)
        key = (func, *[_frozen_key_part(value, keep_floats) for value in spec_args])
    else:
        key = (func, *spec_args)
    prepared = _decision_cache.get(key)
    if prepared is None:
        prepared = _prepare(func, key, tuple(spec_args), {})
    if prepared.simple:
        result = prepared.call(*local_args)
        wrapped = _make_wrapper_subclass(
            DTensor,
            prepared.output_shape,  # type: ignore[arg-type]
            prepared.output_stride,
            None,
            None,
            result.dtype,
            result.layout,
            result.device,
        )
        wrapped._local_tensor = result
        wrapped._spec = prepared.output_spec  # type: ignore[assignment]
        return wrapped
    if prepared.needs_redistribute:
        slot = 0
        input_specs = prepared.input_specs
        _check_input_count(prepared, sum(1 for spec in spec_args if isinstance(spec, DTensorSpec)))
        for position, spec in enumerate(spec_args):
            if isinstance(spec, DTensorSpec):
                target = input_specs[slot]
                if target != spec:
                    _refuse_mutated_redistribute(prepared, position, spec, target)
                    local_args[position] = redistribute_local_tensor(local_args[position], spec, target)
                slot += 1
    for where, value in prepared.overrides:
        local_args[cast(int, where)] = value
    if prepared.random_plan is not None:
        return _finish(prepared, run_random_op(prepared.random_plan, prepared.call, local_args, {}), args, {})
    return _finish(prepared, prepared.call(*local_args), args, {})


_float_values_matter_by_op: dict[torch._ops.OpOverload, bool] = {}


def _float_values_matter(func: torch._ops.OpOverload) -> bool:
    """Whether ``func``'s decision depends on the values of its float arguments, not just their type.

    Rules that say it does not (pointwise ops, foreach ops) share one cache entry across values: an
    optimizer passes new learning-rate-dependent floats every step, which would otherwise add entries.
    """
    matters = _float_values_matter_by_op.get(func)
    if matters is None:
        rule = rule_for(func)
        matters = rule is None or rule.scalar_values_matter
        _float_values_matter_by_op[func] = matters
    return matters


def _frozen_key_part(value: Any, keep_float_values: bool) -> Any:
    """The key part of a fast-path argument (same form as the general path's)."""
    value_type = type(value)
    if value_type is float or value_type is complex:
        return (value_type, value) if keep_float_values else value_type
    if value_type in _TYPE_TAGGED_TYPES:
        return (value_type, value)
    if value_type is list:
        return (list, *value)
    return value


# Separates positional from keyword parts in a general-path key, so that op(x, "a", "b") and
# op(x, a="b") can never share a key.
_KWARGS_MARK = object()


class _ArgConverter:
    """The general path's view of one call: DTensors and accepted plain tensors become specs."""

    __slots__ = ("mesh", "op", "keep_float_values")

    def __init__(self, op: torch._ops.OpOverload, mesh: DeviceMesh) -> None:
        self.op = op
        self.mesh = mesh
        self.keep_float_values = _float_values_matter(op)

    def convert(self, value: Any) -> tuple[Any, Any, Any]:
        """(value for the rules, value for the local op, key part)."""
        if isinstance(value, DTensor):
            spec = value._spec
            return spec, value._local_tensor, spec
        if isinstance(value, _Tensor):
            spec = _replicated_spec_for_plain_tensor(self.op, value, self.mesh)
            return spec, value, spec
        value_type = type(value)
        if value_type is list or value_type is tuple:
            spec_items = []
            local_items = []
            key_items: list[Any] = [value_type]
            for item in value:
                spec_item, local_item, key_item = self.convert(item)
                spec_items.append(spec_item)
                local_items.append(local_item)
                key_items.append(key_item)
            # Locals are always a list so that redistribution can replace items in place.
            return (tuple(spec_items) if value_type is tuple else spec_items), local_items, tuple(key_items)
        if value_type is float or value_type is complex:
            return value, value, ((value_type, value) if self.keep_float_values else value_type)
        if value_type in _TYPE_TAGGED_TYPES:
            return value, value, (value_type, value)
        return value, value, value


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


# Handlers op families install at import (e.g. _foreach_norm's cross-shard reduction). They only exist for
# ops taking tensor lists, which never take the flat fast path, so only this path looks them up.
_builtin_op_handlers = builtin_op_handlers()


def _dispatch_general(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    builtin_handler = _builtin_op_handlers.get(func)
    if builtin_handler is not None:
        handled = builtin_handler(func, args, kwargs)
        if handled is not NotImplemented:
            return handled
    mesh = _find_mesh(args)
    if mesh is None:
        mesh = _find_mesh(kwargs.values())
    if mesh is None:
        raise RuntimeError(f"{func}: DTensor dispatch was called without any DTensor argument")
    converter = _ArgConverter(func, mesh)
    key_parts: list[Any] = [func]
    spec_args: list[Any] = []
    local_args: list[Any] = []
    for arg in args:
        spec_value, local_value, key_value = converter.convert(arg)
        spec_args.append(spec_value)
        local_args.append(local_value)
        key_parts.append(key_value)
    spec_kwargs: dict[str, Any] = {}
    local_kwargs: dict[str, Any] = {}
    if kwargs:
        key_parts.append(_KWARGS_MARK)
    for name, value in kwargs.items():
        spec_value, local_value, key_value = converter.convert(value)
        spec_kwargs[name] = spec_value
        local_kwargs[name] = local_value
        key_parts.append(name)
        key_parts.append(key_value)
    key = tuple(key_parts)
    try:
        prepared = _decision_cache.get(key)
    except TypeError:
        prepared = None
    if prepared is None:
        prepared = _prepare(func, key, tuple(spec_args), spec_kwargs)

    if prepared.needs_redistribute:
        # Slots in flattened order: positional args (into lists), then kwargs.
        slots: list[tuple[Any, Any, DTensorSpec[DeviceMesh], int | str]] = []
        for position, spec_value in enumerate(spec_args):
            _collect_slots(spec_value, local_args, position, position, slots)
        for name, spec_value in spec_kwargs.items():
            _collect_slots(spec_value, local_kwargs, name, name, slots)
        _check_input_count(prepared, len(slots))
        for (container, index, current, location), target in zip(slots, prepared.input_specs):
            if target != current:
                _refuse_mutated_redistribute(prepared, location, current, target)
                container[index] = redistribute_local_tensor(container[index], current, target)
    for where, value in prepared.overrides:
        if isinstance(where, int):
            local_args[where] = value
        else:
            local_kwargs[where] = value
    if prepared.random_plan is not None:
        result = run_random_op(prepared.random_plan, prepared.call, local_args, local_kwargs)
    else:
        result = prepared.call(*local_args, **local_kwargs)
    return _finish(prepared, result, args, kwargs)
